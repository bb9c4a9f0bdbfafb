//! A typed, lossless view of an OCI runtime spec (a bundle's `config.json`) and of
//! an exec process (`runc exec --process process.json`).
//!
//! Lossless: the JSON object itself is kept (serde_json with `preserve_order`), and
//! only the parts gpushare reads or writes (annotations, `process.env`,
//! `process.args`, mounts, hooks) get typed accessors. A field this code does not
//! know, a newer engine's setting or a vendor extension, survives a
//! read-edit-write unchanged and in its place. That is why the spec is not read
//! into the `oci-spec` crate's structs: they drop every field they do not
//! declare, and a wrapper must never silently remove a setting from a container.
//!
//! What gpushare adds (a `Mount`, a `Hook`) and the state a hook reads are the
//! `oci-spec` crate's types: values written or read whole, which lose nothing, and
//! which serialise into the object in the runtime spec's own field names.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A part of the document that is not the JSON type the runtime spec says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the OCI spec's {field} is not {expected}")]
pub struct SpecError {
    pub field: &'static str,
    pub expected: &'static str,
}

/// A container's OCI runtime spec. Deserialising anything but a JSON object fails.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Spec(Map<String, Value>);

/// An exec process (`runc exec --process`, containerd's `Exec` request): the
/// runtime spec's `process` object alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Process(Map<String, Value>);

/// The hook stages gpushare uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookStage {
    CreateRuntime,
    Poststop,
}

impl HookStage {
    fn key(self) -> &'static str {
        match self {
            HookStage::CreateRuntime => "createRuntime",
            HookStage::Poststop => "poststop",
        }
    }

    fn field(self) -> &'static str {
        match self {
            HookStage::CreateRuntime => "hooks.createRuntime",
            HookStage::Poststop => "hooks.poststop",
        }
    }
}

/// A runtime spec mount and hook, and the container state a hook reads on stdin:
/// the `oci-spec` crate's types. Each is a value gpushare writes whole or reads
/// whole, so a field it does not declare is never lost from a container's spec.
pub use oci_spec::runtime::{ContainerState, Hook, Mount, State};

/// A hook as gpushare writes it: `args` and `env` only when not empty (a non-empty
/// `env` is the hook's whole environment), and always a timeout in seconds, since
/// runc has none by default.
pub fn hook(path: String, args: Vec<String>, env: Vec<String>, timeout_seconds: u32) -> Hook {
    let mut hook = Hook::default();
    hook.set_path(path.into());
    hook.set_args(Some(args).filter(|a| !a.is_empty()));
    hook.set_env(Some(env).filter(|e| !e.is_empty()));
    hook.set_timeout(Some(i64::from(timeout_seconds)));
    hook
}

/// A mount as gpushare writes it: every field of the runtime spec's mount set.
pub fn mount(destination: String, kind: &str, source: String, options: Vec<String>) -> Mount {
    let mut mount = Mount::default();
    mount.set_destination(destination.into());
    mount.set_typ(Some(kind.to_owned()));
    mount.set_source(Some(source.into()));
    mount.set_options(Some(options));
    mount
}

/// The container's state as runc, crun and containerd's runtimes hand it to a
/// hook on stdin. Its `status` is one of the runtime spec's four (runc's own
/// `paused` is only in `runc state`, never in a hook's state); a field the spec
/// does not declare is ignored.
pub fn state_from_slice(bytes: &[u8]) -> Result<State, serde_json::Error> {
    serde_json::from_slice(bytes)
}

/// A state annotation's value (runc passes the spec's annotations in the state).
pub fn state_annotation<'a>(state: &'a State, key: &str) -> Option<&'a str> {
    state.annotations().as_ref()?.get(key).map(String::as_str)
}

/// The container's process id, where the state names one (not in a poststop state).
pub fn state_pid(state: &State) -> Option<u32> {
    state
        .pid()
        .and_then(|pid| u32::try_from(pid).ok())
        .filter(|&pid| pid > 0)
}

impl Spec {
    pub fn from_value(value: Value) -> Result<Spec, serde_json::Error> {
        serde_json::from_value(value)
    }

    pub fn from_slice(bytes: &[u8]) -> Result<Spec, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    pub fn into_value(self) -> Value {
        Value::Object(self.0)
    }

    pub fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec(&self.0).expect("a JSON object always serialises")
    }

    /// A string annotation's value.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations()?.get(key)?.as_str()
    }

    /// Whether the annotation is present at all, whatever its value.
    pub fn has_annotation(&self, key: &str) -> bool {
        self.annotations().is_some_and(|a| a.contains_key(key))
    }

    pub fn annotation_keys(&self) -> impl Iterator<Item = &str> {
        self.annotations()
            .into_iter()
            .flat_map(|a| a.keys().map(String::as_str))
    }

    fn annotations(&self) -> Option<&Map<String, Value>> {
        self.0.get("annotations")?.as_object()
    }

    fn process(&self) -> Option<&Map<String, Value>> {
        self.0.get("process")?.as_object()
    }

    /// The container process's environment (`process.env`).
    pub fn env(&self) -> Env<'_> {
        Env::of(self.process())
    }

    /// The container process's command line (`process.args`).
    pub fn args(&self) -> Vec<&str> {
        strings(self.process().and_then(|p| p.get("args")))
    }

    /// The mounts, as far as they have the fields of a `Mount`.
    pub fn mounts(&self) -> Vec<Mount> {
        typed_list(self.0.get("mounts"))
    }

    /// The hooks of one stage, as far as they have the fields of a `Hook`.
    pub fn hooks(&self, stage: HookStage) -> Vec<Hook> {
        typed_list(
            self.0
                .get("hooks")
                .and_then(Value::as_object)
                .and_then(|h| h.get(stage.key())),
        )
    }

    pub fn annotations_mut(&mut self) -> Result<Annotations<'_>, SpecError> {
        object_in(&mut self.0, "annotations", "annotations").map(Annotations)
    }

    /// `process.env`, created where missing.
    pub fn env_mut(&mut self) -> Result<EnvMut<'_>, SpecError> {
        let process = object_in(&mut self.0, "process", "process")?;
        array_in(process, "env", "process.env").map(EnvMut)
    }

    pub fn mounts_mut(&mut self) -> Result<Mounts<'_>, SpecError> {
        array_in(&mut self.0, "mounts", "mounts").map(Mounts)
    }

    pub fn hooks_mut(&mut self, stage: HookStage) -> Result<Hooks<'_>, SpecError> {
        let hooks = object_in(&mut self.0, "hooks", "hooks")?;
        array_in(hooks, stage.key(), stage.field()).map(Hooks)
    }
}

impl Process {
    pub fn from_slice(bytes: &[u8]) -> Result<Process, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    pub fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec(&self.0).expect("a JSON object always serialises")
    }

    pub fn env(&self) -> Env<'_> {
        Env::of(Some(&self.0))
    }

    pub fn args(&self) -> Vec<&str> {
        strings(self.0.get("args"))
    }

    /// `env`, created where missing.
    pub fn env_mut(&mut self) -> Result<EnvMut<'_>, SpecError> {
        array_in(&mut self.0, "env", "process.env").map(EnvMut)
    }
}

/// A process's environment, read as the process would see it.
#[derive(Debug, Clone, Copy)]
pub struct Env<'a>(&'a [Value]);

impl<'a> Env<'a> {
    fn of(process: Option<&'a Map<String, Value>>) -> Self {
        Env(process
            .and_then(|p| p.get("env"))
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice))
    }

    /// The entries (`KEY=value`), in order; entries that are not strings are skipped.
    pub fn entries(&self) -> impl Iterator<Item = &'a str> + 'a {
        self.0.iter().filter_map(Value::as_str)
    }

    /// The value of `key`: its first entry, the one glibc's `getenv` returns.
    pub fn get(&self, key: &str) -> Option<&'a str> {
        self.entries()
            .find_map(|e| e.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
    }
}

/// `process.env` for editing.
pub struct EnvMut<'a>(&'a mut Vec<Value>);

impl EnvMut<'_> {
    pub fn has(&self, key: &str) -> bool {
        self.0.iter().any(|e| env_key(e) == Some(key))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        Env(self.0).get(key)
    }

    /// Sets `key`, replacing every entry for it with one at the place of the first:
    /// images often bake in `NVIDIA_VISIBLE_DEVICES=all`, which must be replaced,
    /// never appended to.
    pub fn set(&mut self, key: &str, value: &str) {
        let entry = Value::String(format!("{key}={value}"));
        match self.0.iter().position(|e| env_key(e) == Some(key)) {
            Some(first) => {
                self.0[first] = entry;
                let mut index = 0;
                self.0.retain(|e| {
                    let keep = index <= first || env_key(e) != Some(key);
                    index += 1;
                    keep
                });
            }
            None => self.0.push(entry),
        }
    }

    /// Puts `item` first in the list `key` holds (`:`- or space-separated, like
    /// `LD_PRELOAD`), keeping the others after it and `item` only once.
    pub fn prepend_to_list(&mut self, key: &str, item: &str) {
        let existing = self.get(key).unwrap_or("").to_owned();
        let mut items = vec![item];
        items.extend(
            existing
                .split([':', ' '])
                .filter(|p| !p.is_empty() && *p != item),
        );
        self.set(key, &items.join(":"));
    }
}

/// The annotations for editing.
pub struct Annotations<'a>(&'a mut Map<String, Value>);

impl Annotations<'_> {
    pub fn set(&mut self, key: &str, value: impl Into<String>) {
        self.0.insert(key.to_owned(), Value::String(value.into()));
    }
}

/// The mounts for editing.
pub struct Mounts<'a>(&'a mut Vec<Value>);

impl Mounts<'_> {
    /// Adds `mount` last, removing any mount at the same destination first.
    pub fn replace(&mut self, mount: Mount) {
        let destination = to_value(mount.destination());
        self.0
            .retain(|m| m.get("destination") != Some(&destination));
        self.0.push(to_value(&mount));
    }
}

/// The hooks of one stage for editing.
pub struct Hooks<'a>(&'a mut Vec<Value>);

impl Hooks<'_> {
    /// Adds `hook` last, removing any hook with the same path first.
    pub fn replace(&mut self, hook: Hook) {
        let path = to_value(hook.path());
        self.0.retain(|h| h.get("path") != Some(&path));
        self.0.push(to_value(&hook));
    }

    /// Adds `hook` before every other hook of the stage.
    pub fn insert_first(&mut self, hook: Hook) {
        self.0.insert(0, to_value(&hook));
    }
}

fn to_value(item: &impl Serialize) -> Value {
    serde_json::to_value(item).expect("a mount or a hook always serialises")
}

fn env_key(entry: &Value) -> Option<&str> {
    entry
        .as_str()
        .map(|e| e.split_once('=').map_or(e, |(k, _)| k))
}

fn strings(list: Option<&Value>) -> Vec<&str> {
    list.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn typed_list<T: serde::de::DeserializeOwned>(list: Option<&Value>) -> Vec<T> {
    list.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|item| serde_json::from_value(item.clone()).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The object at `key`, created where missing or null.
fn object_in<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    field: &'static str,
) -> Result<&'a mut Map<String, Value>, SpecError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Object(Map::new());
    }
    slot.as_object_mut().ok_or(SpecError {
        field,
        expected: "a JSON object",
    })
}

/// The array at `key`, created where missing or null.
fn array_in<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    field: &'static str,
) -> Result<&'a mut Vec<Value>, SpecError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Array(Vec::new());
    }
    slot.as_array_mut().ok_or(SpecError {
        field,
        expected: "a JSON array",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: Value) -> Spec {
        Spec::from_value(value).unwrap()
    }

    #[test]
    fn only_an_object_is_a_spec() {
        for not_a_spec in [json!([]), json!("x"), json!(null), json!(3)] {
            assert!(
                Spec::from_value(not_a_spec.clone()).is_err(),
                "{not_a_spec}"
            );
            assert!(serde_json::from_value::<Process>(not_a_spec).is_err());
        }
    }

    #[test]
    fn reads_what_gpushare_reads() {
        let s = spec(json!({
            "process": {"args": ["sh", "-c", "x"], "env": ["A=1", "B=2", 7, "A=3", "C"]},
            "annotations": {"k": "v", "n": 1},
            "mounts": [{"destination": "/d", "type": "bind", "source": "/s", "options": ["ro"]}, {"x": 1}],
            "hooks": {"poststop": [{"path": "/h", "timeout": 3}]},
        }));
        assert_eq!(s.args(), ["sh", "-c", "x"]);
        assert_eq!(s.env().get("A"), Some("1"), "the first entry, like getenv");
        assert_eq!(s.env().get("C"), None);
        assert_eq!(s.env().entries().count(), 4);
        assert_eq!(s.annotation("k"), Some("v"));
        assert_eq!(s.annotation("n"), None, "not a string");
        assert!(s.has_annotation("n"));
        assert_eq!(s.annotation_keys().collect::<Vec<_>>(), ["k", "n"]);
        assert_eq!(s.mounts().len(), 1, "only mounts with a destination");
        assert_eq!(
            s.mounts()[0].options().as_deref(),
            Some(&["ro".to_owned()][..])
        );
        assert_eq!(
            s.hooks(HookStage::Poststop),
            [hook("/h".into(), vec![], vec![], 3)]
        );
        assert!(s.hooks(HookStage::CreateRuntime).is_empty());
        let empty = spec(json!({}));
        assert!(empty.args().is_empty() && empty.env().get("A").is_none());
    }

    #[test]
    fn wrong_types_are_named_errors() {
        let mut s =
            spec(json!({"process": {"env": "x"}, "hooks": [], "mounts": {}, "annotations": 1}));
        assert_eq!(s.env_mut().err().unwrap().field, "process.env");
        assert_eq!(
            s.hooks_mut(HookStage::Poststop).err().unwrap().field,
            "hooks"
        );
        assert_eq!(s.mounts_mut().err().unwrap().field, "mounts");
        assert!(s
            .annotations_mut()
            .err()
            .unwrap()
            .to_string()
            .contains("annotations is not a JSON object"));
    }

    #[test]
    fn missing_and_null_parts_are_created() {
        let mut s = spec(json!({"hooks": null, "process": {"env": null}}));
        s.env_mut().unwrap().set("A", "1");
        s.hooks_mut(HookStage::CreateRuntime).unwrap().replace(hook(
            "/h".into(),
            vec!["/h".into()],
            vec![],
            1,
        ));
        s.annotations_mut().unwrap().set("k", "v");
        assert_eq!(
            s.into_value(),
            json!({"hooks": {"createRuntime": [{"path": "/h", "args": ["/h"], "timeout": 1}]},
                   "process": {"env": ["A=1"]}, "annotations": {"k": "v"}})
        );
    }

    #[test]
    fn set_replaces_every_entry_at_the_place_of_the_first() {
        let mut p: Process =
            serde_json::from_value(json!({"env": ["K=a", "P=1", "K=b", "K", "Q=2"]})).unwrap();
        p.env_mut().unwrap().set("K", "c");
        assert_eq!(p.env().entries().collect::<Vec<_>>(), ["K=c", "P=1", "Q=2"]);
        p.env_mut().unwrap().set("N", "1");
        assert_eq!(p.env().get("N"), Some("1"));
        let mut env = p.env_mut().unwrap();
        env.set("LD_PRELOAD", "/a.so /lib.so");
        env.prepend_to_list("LD_PRELOAD", "/lib.so");
        assert_eq!(env.get("LD_PRELOAD"), Some("/lib.so:/a.so"));
    }

    #[test]
    fn mounts_and_hooks_replace_their_own_earlier_copy() {
        let mut s = spec(
            json!({"mounts": [{"destination": "/d", "type": "tmpfs", "vendor": 1}, {"destination": "/e"}]}),
        );
        let mount = mount("/d".into(), "bind", "/s".into(), vec!["ro".into()]);
        s.mounts_mut().unwrap().replace(mount.clone());
        s.mounts_mut().unwrap().replace(mount.clone());
        assert_eq!(s.mounts().len(), 2);
        assert_eq!(s.mounts()[1], mount);
        let hook = |path: &str| {
            let mut hook = Hook::default();
            hook.set_path(path.into());
            hook
        };
        let mut hooks = s.hooks_mut(HookStage::Poststop).unwrap();
        hooks.replace(hook("/a"));
        hooks.replace(hook("/b"));
        hooks.replace(hook("/a"));
        hooks.insert_first(hook("/f"));
        let paths: Vec<String> = s
            .hooks(HookStage::Poststop)
            .into_iter()
            .map(|h| h.path().display().to_string())
            .collect();
        assert_eq!(paths, ["/f", "/b", "/a"]);
    }

    #[test]
    fn a_runtime_hook_state_reads_into_the_oci_state() {
        // As runc hands it to a createRuntime hook under containerd's CRI plugin,
        // with a field the runtime spec does not declare.
        let created = br#"{"ociVersion":"1.2.0","id":"8d3f0c1e","status":"creating","pid":41234,
            "bundle":"/run/containerd/io.containerd.runtime.v2.task/k8s.io/8d3f0c1e",
            "annotations":{"io.kubernetes.cri.container-type":"container",
                           "gpushare.io/lease":"lease-7"},"x-vendor":{"a":1}}"#;
        let state = state_from_slice(created).unwrap();
        assert_eq!(state.id(), "8d3f0c1e");
        assert_eq!(*state.status(), ContainerState::Creating);
        assert_eq!(state_pid(&state), Some(41234));
        assert_eq!(
            state.bundle().to_str(),
            Some("/run/containerd/io.containerd.runtime.v2.task/k8s.io/8d3f0c1e")
        );
        assert_eq!(
            state_annotation(&state, "gpushare.io/lease"),
            Some("lease-7")
        );
        assert_eq!(state_annotation(&state, "absent"), None);

        // A poststop state: stopped, no pid (or pid 0), no annotations.
        for stopped in [
            &br#"{"ociVersion":"1.0.2","id":"c","status":"stopped","bundle":"/b"}"#[..],
            br#"{"ociVersion":"1.0.2","id":"c","status":"stopped","pid":0,"bundle":"/b"}"#,
        ] {
            let state = state_from_slice(stopped).unwrap();
            assert_eq!(*state.status(), ContainerState::Stopped);
            assert_eq!(state_pid(&state), None);
            assert_eq!(state_annotation(&state, "gpushare.io/lease"), None);
        }
        assert!(state_from_slice(b"\"c\"").is_err());
        assert!(state_from_slice(br#"{"id":"c","pid":"12"}"#).is_err());
    }

    #[test]
    fn an_added_mount_and_hook_round_trip_in_the_spec_field_names() {
        let mut s = spec(json!({"mounts": [], "hooks": {}}));
        let added_mount = mount(
            "/usr/lib/libgpushare.so".into(),
            "bind",
            "/opt/gpushare/lib/libgpushare.so".into(),
            vec!["rbind".into(), "ro".into()],
        );
        let added_hook = hook(
            "/usr/bin/gpushare-hook".into(),
            vec!["gpushare-hook".into(), "poststop".into()],
            vec!["PATH=/usr/bin".into()],
            10,
        );
        s.mounts_mut().unwrap().replace(added_mount.clone());
        s.hooks_mut(HookStage::Poststop)
            .unwrap()
            .replace(added_hook.clone());
        let written = s.to_vec();
        assert_eq!(
            String::from_utf8(written.clone()).unwrap(),
            concat!(
                r#"{"mounts":[{"destination":"/usr/lib/libgpushare.so","type":"bind","#,
                r#""source":"/opt/gpushare/lib/libgpushare.so","options":["rbind","ro"]}],"#,
                r#""hooks":{"poststop":[{"path":"/usr/bin/gpushare-hook","#,
                r#""args":["gpushare-hook","poststop"],"env":["PATH=/usr/bin"],"timeout":10}]}}"#
            )
        );
        let read = Spec::from_slice(&written).unwrap();
        assert_eq!(read.mounts(), [added_mount]);
        assert_eq!(read.hooks(HookStage::Poststop), [added_hook]);
    }

    proptest::proptest! {
        /// Whatever else a spec holds, in whatever order, an edit through the typed
        /// view changes only what it edits: the rest is read back unchanged and in place.
        #[test]
        fn unknown_fields_survive_an_edit(
            extra in proptest::collection::vec(("[a-z]{1,8}", any_json()), 0..8),
            process_extra in proptest::collection::vec(("[a-z]{1,8}", any_json()), 0..4),
        ) {
            let mut object = Map::new();
            for (k, v) in &extra {
                object.insert(format!("x-{k}"), v.clone());
            }
            let mut process = Map::new();
            for (k, v) in &process_extra {
                process.insert(format!("x-{k}"), v.clone());
            }
            object.insert("process".into(), Value::Object(process.clone()));
            let original = Value::Object(object);
            let bytes = serde_json::to_vec(&original).unwrap();
            let mut s = Spec::from_slice(&bytes).unwrap();
            proptest::prop_assert_eq!(&s.clone().into_value(), &original);
            s.env_mut().unwrap().set("A", "1");
            s.annotations_mut().unwrap().set("k", "v");
            let mut edited = s.into_value();
            let edited_object = edited.as_object_mut().unwrap();
            proptest::prop_assert_eq!(edited_object.remove("annotations"), Some(json!({"k": "v"})));
            let edited_process = edited_object["process"].as_object_mut().unwrap();
            proptest::prop_assert_eq!(edited_process.remove("env"), Some(json!(["A=1"])));
            // Same content, same order.
            proptest::prop_assert_eq!(serde_json::to_vec(&edited).unwrap(), bytes);
        }
    }

    fn any_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[ -~]{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::vec(("[a-z]{1,6}", inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }
}
