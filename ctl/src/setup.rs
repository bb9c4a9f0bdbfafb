//! `gpusharectl setup docker|containerd|podman|crio [--undo]`: adds the gpushare runtime to
//! a container engine's configuration, or takes it out again, as `nvidia-ctk runtime
//! configure` does for NVIDIA's. CRI-O's goes into a drop-in of its own
//! (`/etc/crio/crio.conf.d/50-gpushare.conf`), which CRI-O merges over crio.conf.
//!
//! The edits are pure ([`configure`], [`undo`]: text in, text out) and the file handling
//! ([`apply`]) is separate. Three promises, each table-tested:
//! - every other setting is kept: docker's daemon.json is edited as JSON keeping every key
//!   in its order; containerd's and podman's TOML through toml_edit, keeping comments and
//!   formatting;
//! - running it twice changes nothing the second time: a runtime entry already as wanted
//!   leaves the text untouched, byte for byte;
//! - `--undo` gives back the file as it was: the first edit keeps the original next to the
//!   file (`<file>.gpushare-backup`) and undo restores it byte for byte while the file is
//!   still what setup wrote; edited since, undo removes exactly the entry setup added
//!   (and the tables it created), keeping the later edits.
//!
//! Files are written as root, so symlink-safely: a config that is a symbolic link
//! (into a managed tree) is edited where the link points and stays a link; the new
//! text goes through a randomly named temporary file created exclusively beside it
//! and renamed over it; the backup is created exclusively and read without
//! following a link, so a link planted at either name is never written, chmodded or
//! read through.
//!
//! The engine is never restarted: the report names what to restart.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use toml_edit::{Array, DocumentMut, Item, Table};

/// The runtime's name in every engine: `docker run --runtime gpushare`, a RuntimeClass's
/// `handler: gpushare`, `podman --runtime gpushare`.
pub const RUNTIME_NAME: &str = "gpushare";

/// Where the original file is kept by the first edit: `<file>` + this.
pub const BACKUP_SUFFIX: &str = ".gpushare-backup";

/// containerd's CRI runtime table, by configuration version (4 keeps 3's).
const CONTAINERD_V2_RUNTIMES: [&str; 5] = [
    "plugins",
    "io.containerd.grpc.v1.cri",
    "containerd",
    "runtimes",
    RUNTIME_NAME,
];
const CONTAINERD_V3_RUNTIMES: [&str; 5] = [
    "plugins",
    "io.containerd.cri.v1.runtime",
    "containerd",
    "runtimes",
    RUNTIME_NAME,
];
const PODMAN_RUNTIMES: [&str; 2] = ["engine", "runtimes"];
/// docker's daemon.json key naming the default runtime.
const DOCKER_DEFAULT_RUNTIME: &str = "default-runtime";
/// The CRI plugin's key (beside `runtimes`, in its `containerd` table) naming the runtime of
/// pods that name no RuntimeClass.
const CONTAINERD_DEFAULT_RUNTIME: &str = "default_runtime_name";
const CRIO_RUNTIMES: [&str; 3] = ["crio", "runtime", "runtimes"];

/// Requests reach the spec through these (config/containerd/*.toml says why grant keys
/// come only through container annotations).
const POD_ANNOTATIONS: [&str; 1] = ["gpushare.io/*"];
const CONTAINER_ANNOTATIONS: [&str; 2] = ["gpushare.io/*", "grant.gpushare.io/*"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    Docker,
    Containerd,
    Podman,
    Crio,
}

impl Engine {
    /// The system-wide configuration file the engine reads.
    pub fn default_config(self) -> &'static Path {
        Path::new(match self {
            Engine::Docker => "/etc/docker/daemon.json",
            Engine::Containerd => "/etc/containerd/config.toml",
            Engine::Podman => "/etc/containers/containers.conf",
            // A drop-in: CRI-O reads crio.conf, then crio.conf.d/*.conf in lexical order.
            Engine::Crio => "/etc/crio/crio.conf.d/50-gpushare.conf",
        })
    }

    /// What the operator restarts for the edit to take effect.
    pub fn restart_hint(self) -> &'static str {
        match self {
            Engine::Docker => "restart docker to use it: systemctl restart docker",
            Engine::Containerd => "restart containerd to use it: systemctl restart containerd",
            Engine::Podman => "podman reads containers.conf at each command: nothing to restart",
            Engine::Crio => "restart CRI-O to use it: systemctl restart crio",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Engine::Docker => "docker",
            Engine::Containerd => "containerd",
            Engine::Podman => "podman",
            Engine::Crio => "crio",
        })
    }
}

/// The installed programs the engines are pointed at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Programs {
    /// gpushare-runc: docker's and podman's runtime, runc's BinaryName for containerd.
    pub runc: PathBuf,
    /// Runtime profiles (`[runtime.profiles.NAME]` of gpushare's configuration) that
    /// each get a docker runtime entry of their own, `gpushare-NAME`: docker 20.10
    /// has no annotations, so a runtime entry only the operator writes is how a
    /// container's creator, rather than its image, gets more than the environment
    /// may ask.
    pub docker_profiles: Vec<String>,
    /// `--set-as-default`: the engine's default runtime becomes gpushare's (docker's
    /// `default-runtime`, the CRI plugin's `default_runtime_name`), so containers and pods
    /// that name no runtime or RuntimeClass go through gpushare-runc too.
    pub set_as_default: bool,
}

impl Programs {
    /// The programs installed beside `dir` (gpusharectl's own directory by default).
    pub fn in_dir(dir: &Path) -> Programs {
        Programs {
            runc: dir.join("gpushare-runc"),
            docker_profiles: Vec::new(),
            set_as_default: false,
        }
    }

    /// Also making gpushare the engine's default runtime.
    pub fn as_default(mut self, set_as_default: bool) -> Programs {
        self.set_as_default = set_as_default;
        self
    }

    /// With a docker runtime entry for each of `profiles`.
    pub fn with_docker_profiles(mut self, profiles: Vec<String>) -> Programs {
        self.docker_profiles = profiles;
        self
    }
}

/// gpushare-runc's flag naming the runtime profile (`gpushare_oci::runc_args`).
pub const PROFILE_FLAG: &str = "--gpushare-profile";

/// The docker runtime that grants the runtime profile `profile`.
pub fn docker_profile_runtime(profile: &str) -> String {
    format!("{RUNTIME_NAME}-{profile}")
}

/// The docker runtime entry of `profile`. dockerd runs an entry with `runtimeArgs`
/// through a script of its own, `path runtimeArgs $@`, so the flag comes before
/// runc's global flags, as one word (a profile name has no character a shell
/// would split or expand).
fn docker_profile_entry(runc: &str, profile: &str) -> Value {
    serde_json::json!({
        "path": runc,
        "runtimeArgs": [format!("{PROFILE_FLAG}={profile}")],
    })
}

/// The profiles whose entries setup wrote into docker's `runtimes`, in their order.
fn docker_profiles_in(runtimes: &Map<String, Value>) -> Vec<String> {
    runtimes
        .iter()
        .filter_map(|(name, entry)| {
            let profile = name.strip_prefix(&format!("{RUNTIME_NAME}-"))?;
            let runc = entry.get("path")?.as_str()?;
            (entry == &docker_profile_entry(runc, profile)).then(|| profile.to_owned())
        })
        .collect()
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SetupError {
    #[error("{engine} configuration is not valid {format}: {reason}")]
    Parse {
        engine: Engine,
        format: &'static str,
        reason: String,
    },
    #[error("{engine} configuration: {key} is {found}, where a table (object) is expected; gpushare's runtime goes inside it")]
    NotATable {
        engine: Engine,
        key: String,
        found: &'static str,
    },
    #[error("containerd configuration: version = {found} is not supported; accepted: 2 (containerd 1.6, 1.7; 2.x reads it too), 3 (containerd 2.x) or 4 (containerd 2.3 and later){hint}")]
    ContainerdVersion { found: String, hint: &'static str },
    #[error("cannot {what} {path}: {reason}")]
    Io {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{path}: a program path must be valid UTF-8 to be written into a configuration")]
    NotUtf8 { path: PathBuf },
}

/// Adds (or corrects) gpushare's runtime in `text`, an engine configuration file's content
/// ("" for a file that does not exist). Already as wanted: `text` itself, unchanged.
pub fn configure(engine: Engine, text: &str, programs: &Programs) -> Result<String, SetupError> {
    match engine {
        Engine::Docker => configure_docker(text, programs),
        Engine::Containerd => configure_containerd(text, programs),
        Engine::Podman => configure_podman(text, programs),
        Engine::Crio => configure_crio(text, programs),
    }
}

/// Takes gpushare's runtime out of `current`. `backup` is the file as it was before setup
/// first changed it (None: no backup, or there was no file). While `current` is still
/// exactly what setup made of the backup, the backup comes back byte for byte; otherwise
/// only what setup added goes. `Ok(None)`: the file should not exist (setup created it
/// and nothing else was put in it since).
pub fn undo(
    engine: Engine,
    current: &str,
    backup: Option<&str>,
    programs: &Programs,
) -> Result<Option<String>, SetupError> {
    // The byte-for-byte test asks what setup made of the backup, profiles included.
    let with_profiles;
    let programs = match engine {
        Engine::Docker => {
            let profiles = docker_runtimes(&parse_json(current)?)
                .map(docker_profiles_in)
                .unwrap_or_default();
            with_profiles = programs.clone().with_docker_profiles(profiles);
            &with_profiles
        }
        _ => programs,
    };
    // Whether setup also made gpushare the default is read from the file, not asked again.
    let as_made = programs.clone().as_default(is_default(engine, current)?);
    let programs = &as_made;
    if let Some(original) = backup {
        if configure(engine, original, programs)? == current {
            return Ok(Some(original.to_owned()));
        }
    }
    let removed = match engine {
        Engine::Docker => unconfigure_docker(current)?,
        Engine::Containerd => unconfigure_containerd(current)?,
        Engine::Podman => unconfigure_toml(engine, current, &PODMAN_RUNTIMES)?,
        Engine::Crio => unconfigure_toml(engine, current, &CRIO_RUNTIMES)?,
    };
    // A file setup created (no backup) holding nothing but what it wrote.
    if backup.is_none() && configure(engine, "", programs)? == current {
        return Ok(None);
    }
    Ok(Some(removed))
}

/// Whether `text` makes gpushare's runtime the engine's default (`--set-as-default`).
pub fn is_default(engine: Engine, text: &str) -> Result<bool, SetupError> {
    Ok(match engine {
        Engine::Docker => {
            parse_json(text)?
                .get(DOCKER_DEFAULT_RUNTIME)
                .and_then(Value::as_str)
                == Some(RUNTIME_NAME)
        }
        Engine::Containerd => {
            let doc = parse_toml(engine, text)?;
            [&CONTAINERD_V2_RUNTIMES, &CONTAINERD_V3_RUNTIMES]
                .iter()
                .any(|path| {
                    let mut key = path[..3].to_vec();
                    key.push(CONTAINERD_DEFAULT_RUNTIME);
                    lookup(doc.as_table(), &key).and_then(Item::as_str) == Some(RUNTIME_NAME)
                })
        }
        Engine::Podman | Engine::Crio => false,
    })
}

/// Whether `text` names gpushare's runtime (`make uninstall` refuses while one does).
pub fn is_configured(engine: Engine, text: &str) -> Result<bool, SetupError> {
    Ok(match engine {
        Engine::Docker => {
            docker_runtimes(&parse_json(text)?).is_some_and(|r| r.contains_key(RUNTIME_NAME))
        }
        Engine::Containerd => {
            let doc = parse_toml(engine, text)?;
            [&CONTAINERD_V2_RUNTIMES, &CONTAINERD_V3_RUNTIMES]
                .iter()
                .any(|path| lookup(doc.as_table(), &path[..]).is_some())
        }
        Engine::Podman => {
            let doc = parse_toml(engine, text)?;
            lookup(
                doc.as_table(),
                &[PODMAN_RUNTIMES[0], PODMAN_RUNTIMES[1], RUNTIME_NAME],
            )
            .is_some()
        }
        Engine::Crio => {
            let doc = parse_toml(engine, text)?;
            let mut path = CRIO_RUNTIMES.to_vec();
            path.push(RUNTIME_NAME);
            lookup(doc.as_table(), &path).is_some()
        }
    })
}

fn utf8(path: &Path) -> Result<&str, SetupError> {
    path.to_str().ok_or_else(|| SetupError::NotUtf8 {
        path: path.to_owned(),
    })
}

// ----------------------------------------------------------------------------------------
// docker: daemon.json
// ----------------------------------------------------------------------------------------

fn parse_json(text: &str) -> Result<Map<String, Value>, SetupError> {
    if text.trim().is_empty() {
        return Ok(Map::new());
    }
    let parse = |reason: String| SetupError::Parse {
        engine: Engine::Docker,
        format: "JSON",
        reason,
    };
    match serde_json::from_str::<Value>(text).map_err(|e| parse(e.to_string()))? {
        Value::Object(map) => Ok(map),
        other => Err(parse(format!(
            "the top level is {}, where dockerd expects an object",
            json_kind(&other)
        ))),
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn docker_runtimes(config: &Map<String, Value>) -> Option<&Map<String, Value>> {
    config.get("runtimes").and_then(Value::as_object)
}

/// daemon.json as dockerd writes it: two-space indentation and a final newline.
fn render_json(config: &Map<String, Value>) -> String {
    let mut text = serde_json::to_string_pretty(config).expect("a JSON map always serialises");
    text.push('\n');
    text
}

fn configure_docker(text: &str, programs: &Programs) -> Result<String, SetupError> {
    let mut config = parse_json(text)?;
    // "path" works on every docker release that has runtimes (docker 24's runtimeType with
    // BinaryName is the same program through containerd's runc shim).
    let wanted = serde_json::json!({ "path": utf8(&programs.runc)? });
    let default_wanted = programs.set_as_default
        && config.get(DOCKER_DEFAULT_RUNTIME).and_then(Value::as_str) != Some(RUNTIME_NAME);
    let runtimes = config
        .entry("runtimes")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(runtimes) = runtimes else {
        return Err(SetupError::NotATable {
            engine: Engine::Docker,
            key: "runtimes".into(),
            found: json_kind(runtimes),
        });
    };
    let runc = utf8(&programs.runc)?;
    let mut entries = vec![(RUNTIME_NAME.to_owned(), wanted)];
    for profile in &programs.docker_profiles {
        entries.push((
            docker_profile_runtime(profile),
            docker_profile_entry(runc, profile),
        ));
    }
    if !default_wanted
        && entries
            .iter()
            .all(|(name, entry)| runtimes.get(name) == Some(entry))
    {
        return Ok(text.to_owned());
    }
    for (name, entry) in entries {
        runtimes.insert(name, entry);
    }
    if default_wanted {
        config.insert(DOCKER_DEFAULT_RUNTIME.into(), RUNTIME_NAME.into());
    }
    Ok(render_json(&config))
}

fn unconfigure_docker(text: &str) -> Result<String, SetupError> {
    let mut config = parse_json(text)?;
    // A default naming the runtime taken out would stop dockerd from starting; docker's
    // own default (runc) applies again.
    let was_default =
        config.get(DOCKER_DEFAULT_RUNTIME).and_then(Value::as_str) == Some(RUNTIME_NAME);
    if was_default {
        config.shift_remove(DOCKER_DEFAULT_RUNTIME);
    }
    let Some(Value::Object(runtimes)) = config.get_mut("runtimes") else {
        return Ok(if was_default {
            render_json(&config)
        } else {
            text.to_owned()
        });
    };
    let profiles = docker_profiles_in(runtimes);
    let mut removed = runtimes.shift_remove(RUNTIME_NAME).is_some();
    for profile in profiles {
        removed |= runtimes
            .shift_remove(&docker_profile_runtime(&profile))
            .is_some();
    }
    if !removed && !was_default {
        return Ok(text.to_owned());
    }
    if runtimes.is_empty() {
        config.shift_remove("runtimes");
    }
    Ok(render_json(&config))
}

// ----------------------------------------------------------------------------------------
// containerd (config.toml, version 2 or 3) and podman (containers.conf): TOML
// ----------------------------------------------------------------------------------------

fn parse_toml(engine: Engine, text: &str) -> Result<DocumentMut, SetupError> {
    text.parse::<DocumentMut>().map_err(|e| SetupError::Parse {
        engine,
        format: "TOML",
        reason: e.to_string().trim_end().to_owned(),
    })
}

fn item_kind(item: &Item) -> &'static str {
    match item {
        Item::None => "absent",
        Item::Value(v) if v.is_inline_table() => "an inline table",
        Item::Value(_) => "a value",
        Item::Table(_) => "a table",
        Item::ArrayOfTables(_) => "an array of tables",
    }
}

fn lookup<'a>(table: &'a Table, path: &[&str]) -> Option<&'a Item> {
    let (first, rest) = path.split_first()?;
    let item = table.get(first)?;
    if rest.is_empty() {
        return Some(item);
    }
    lookup(item.as_table()?, rest)
}

fn lookup_mut<'a>(table: &'a mut Table, path: &[&str]) -> Option<&'a mut Item> {
    let (first, rest) = path.split_first()?;
    let item = table.get_mut(first)?;
    if rest.is_empty() {
        return Some(item);
    }
    lookup_mut(item.as_table_mut()?, rest)
}

/// The table at `path`, created where missing: the parents implicit (no header of their
/// own, as a hand-written file has them), the last explicit.
fn table_at<'a>(
    engine: Engine,
    root: &'a mut Table,
    path: &[&str],
) -> Result<&'a mut Table, SetupError> {
    let mut table = root;
    for (depth, key) in path.iter().enumerate() {
        let last = depth + 1 == path.len();
        let item = table.entry(key).or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(!last);
            Item::Table(t)
        });
        let found = item_kind(item);
        table = item.as_table_mut().ok_or_else(|| SetupError::NotATable {
            engine,
            key: path[..=depth].join("."),
            found,
        })?;
    }
    Ok(table)
}

fn string_array(values: &[&str]) -> Item {
    toml_edit::value(values.iter().copied().collect::<Array>())
}

/// Sets `key` unless it already holds `wanted` (so an unchanged entry keeps its formatting).
fn ensure(table: &mut Table, key: &str, wanted: Item) {
    let same = match (table.get(key).and_then(Item::as_value), wanted.as_value()) {
        (Some(have), Some(want)) => toml_values_equal(have, want),
        _ => false,
    };
    if !same {
        table.insert(key, wanted);
    }
}

fn toml_values_equal(a: &toml_edit::Value, b: &toml_edit::Value) -> bool {
    use toml_edit::Value as V;
    match (a, b) {
        (V::String(a), V::String(b)) => a.value() == b.value(),
        (V::Integer(a), V::Integer(b)) => a.value() == b.value(),
        (V::Boolean(a), V::Boolean(b)) => a.value() == b.value(),
        (V::Array(a), V::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b.iter()).all(|(a, b)| toml_values_equal(a, b))
        }
        _ => false,
    }
}

/// containerd's configuration version: 2 for a new (empty) file, which containerd 1.6,
/// 1.7 and 2.x all read.
fn containerd_version(doc: &DocumentMut, text: &str) -> Result<i64, SetupError> {
    match doc.get("version") {
        Some(item) => match item.as_integer() {
            // Version 4 (containerd 2.3's `config default` and `config migrate`) keeps
            // version 3's CRI runtime table.
            Some(v @ (2..=4)) => Ok(v),
            _ => Err(SetupError::ContainerdVersion {
                found: item.to_string().trim().to_owned(),
                hint: "",
            }),
        },
        None if text.trim().is_empty() => Ok(2),
        None => Err(SetupError::ContainerdVersion {
            found: "absent (version 1)".into(),
            hint: "; convert the file first: containerd config migrate",
        }),
    }
}

fn configure_containerd(text: &str, programs: &Programs) -> Result<String, SetupError> {
    let engine = Engine::Containerd;
    let mut doc = parse_toml(engine, text)?;
    let version = containerd_version(&doc, text)?;
    if doc.get("version").is_none() {
        doc.insert("version", toml_edit::value(version));
    }
    let path: &[&str] = if version == 2 {
        &CONTAINERD_V2_RUNTIMES
    } else {
        &CONTAINERD_V3_RUNTIMES
    };
    // runc's own cgroup driver, as nvidia-ctk copies it: the kubelet's must match.
    let mut runc_options = path[..path.len() - 1].to_vec();
    runc_options.extend(["runc", "options", "SystemdCgroup"]);
    let systemd_cgroup = lookup(doc.as_table(), &runc_options).and_then(Item::as_bool);

    // runc's shim running gpushare-runc as runc's binary, in both versions: the gpushare
    // shim as runtime_path (config/containerd/config-v2.toml) is silently replaced by
    // plain runc on containerd before 1.6.21 and 1.7.2 (Debian 12 ships 1.6.20), whereas
    // BinaryName works on every release that reads version 2, and keeps runc's options.
    let runtime = table_at(engine, doc.as_table_mut(), path)?;
    ensure(
        runtime,
        "runtime_type",
        toml_edit::value("io.containerd.runc.v2"),
    );
    ensure(runtime, "pod_annotations", string_array(&POD_ANNOTATIONS));
    ensure(
        runtime,
        "container_annotations",
        string_array(&CONTAINER_ANNOTATIONS),
    );
    let options = table_at(engine, runtime, &["options"])?;
    ensure(
        options,
        "BinaryName",
        toml_edit::value(utf8(&programs.runc)?),
    );
    if let Some(systemd) = systemd_cgroup {
        ensure(options, "SystemdCgroup", toml_edit::value(systemd));
    }
    if programs.set_as_default {
        let cri = table_at(engine, doc.as_table_mut(), &path[..3])?;
        ensure(
            cri,
            CONTAINERD_DEFAULT_RUNTIME,
            toml_edit::value(RUNTIME_NAME),
        );
    }
    let edited = doc.to_string();
    Ok(if edited == text {
        text.to_owned()
    } else {
        edited
    })
}

fn unconfigure_containerd(text: &str) -> Result<String, SetupError> {
    // A default naming the runtime taken out: the CRI plugin's own (runc) applies again.
    let mut doc = parse_toml(Engine::Containerd, text)?;
    let mut removed_default = false;
    for path in [&CONTAINERD_V2_RUNTIMES, &CONTAINERD_V3_RUNTIMES] {
        if let Some(Item::Table(cri)) = lookup_mut(doc.as_table_mut(), &path[..3]) {
            if cri.get(CONTAINERD_DEFAULT_RUNTIME).and_then(Item::as_str) == Some(RUNTIME_NAME) {
                cri.remove(CONTAINERD_DEFAULT_RUNTIME);
                removed_default = true;
            }
        }
    }
    let mut out = if removed_default {
        doc.to_string()
    } else {
        text.to_owned()
    };
    for path in [&CONTAINERD_V2_RUNTIMES, &CONTAINERD_V3_RUNTIMES] {
        out = unconfigure_toml(Engine::Containerd, &out, &path[..path.len() - 1])?;
    }
    Ok(out)
}

/// Removes gpushare's runtime from the table at `path`, then that table if it is left
/// empty, then every table above it left empty with no header of its own (implicit).
fn unconfigure_toml(engine: Engine, text: &str, path: &[&str]) -> Result<String, SetupError> {
    let mut doc = parse_toml(engine, text)?;
    let removed = remove_at(doc.as_table_mut(), path, RUNTIME_NAME);
    Ok(if removed {
        doc.to_string()
    } else {
        text.to_owned()
    })
}

/// true when something was removed.
fn remove_at(table: &mut Table, path: &[&str], key: &str) -> bool {
    match path.split_first() {
        None => table.remove(key).is_some(),
        Some((first, rest)) => {
            let Some(child) = table.get_mut(first).and_then(Item::as_table_mut) else {
                return false;
            };
            let removed = remove_at(child, rest, key);
            // The table that held the runtime goes too once empty, header or not: setup
            // writes one for the table it creates ([engine.runtimes]).
            if removed && child.is_empty() && (child.is_implicit() || rest.is_empty()) {
                table.remove(first);
            }
            removed
        }
    }
}

fn configure_podman(text: &str, programs: &Programs) -> Result<String, SetupError> {
    let engine = Engine::Podman;
    let mut doc = parse_toml(engine, text)?;
    let runtimes = table_at(engine, doc.as_table_mut(), &PODMAN_RUNTIMES)?;
    // podman's runtimes are lists of candidate paths; the first that exists is used.
    ensure(
        runtimes,
        RUNTIME_NAME,
        string_array(&[utf8(&programs.runc)?]),
    );
    let edited = doc.to_string();
    Ok(if edited == text {
        text.to_owned()
    } else {
        edited
    })
}

/// CRI-O's runtime table (crio.conf(5), `[crio.runtime.runtimes.NAME]`): gpushare-runc as an
/// OCI runtime, as a RuntimeClass's `handler: gpushare` selects it. CRI-O puts the pod's and
/// container's annotations into the spec itself, so no annotation list is needed.
fn configure_crio(text: &str, programs: &Programs) -> Result<String, SetupError> {
    let engine = Engine::Crio;
    let mut doc = parse_toml(engine, text)?;
    let mut path = CRIO_RUNTIMES.to_vec();
    path.push(RUNTIME_NAME);
    let runtime = table_at(engine, doc.as_table_mut(), &path)?;
    ensure(
        runtime,
        "runtime_path",
        toml_edit::value(utf8(&programs.runc)?),
    );
    ensure(runtime, "runtime_type", toml_edit::value("oci"));
    let edited = doc.to_string();
    Ok(if edited == text {
        text.to_owned()
    } else {
        edited
    })
}

// ----------------------------------------------------------------------------------------
// The file: read, back up, write
// ----------------------------------------------------------------------------------------

/// What [`apply`] did, for the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub engine: Engine,
    pub path: PathBuf,
    pub action: Action,
    /// The file's new content (None: removed); with `dry_run`, what would be written.
    pub content: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Unchanged,
    Written,
    Restored,
    Removed,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path.display();
        match self.action {
            Action::Unchanged => {
                return write!(f, "{path}: already as wanted, nothing changed")
            }
            Action::Written => write!(
                f,
                "{path}: runtime \"{RUNTIME_NAME}\" added (gpusharectl setup --undo {} takes it out); ",
                self.engine
            )?,
            Action::Restored => write!(f, "{path}: gpushare's runtime removed; ")?,
            Action::Removed => write!(f, "{path}: removed (setup had created it); ")?,
        }
        f.write_str(self.engine.restart_hint())
    }
}

fn backup_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(BACKUP_SUFFIX);
    PathBuf::from(name)
}

/// How many links deep an engine's config may lie (the kernel's own bound).
const MAX_LINKS: usize = 40;

/// The file an edit of `path` lands in: `path` itself, or where its symbolic links
/// lead (a dangling one too: setup then creates the file it names). Replacing the
/// link by a file would cut the config off from whatever manages it.
fn edited_file(path: &Path) -> Result<PathBuf, SetupError> {
    let mut file = path.to_owned();
    for _ in 0..MAX_LINKS {
        match std::fs::symlink_metadata(&file) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(&file).map_err(io_error("read the link", &file))?;
                file = match file.parent() {
                    Some(dir) => dir.join(target),
                    None => target,
                };
            }
            Ok(_) => return Ok(file),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(file),
            Err(e) => return Err(io_error("inspect", &file)(e)),
        }
    }
    Err(SetupError::Io {
        what: "resolve",
        path: path.to_owned(),
        reason: format!("more than {MAX_LINKS} symbolic links"),
    })
}

fn read_optional(path: &Path) -> Result<Option<String>, SetupError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SetupError::Io {
            what: "read",
            path: path.to_owned(),
            reason: e.to_string(),
        }),
    }
}

fn io_error<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> SetupError + 'a {
    move |e| SetupError::Io {
        what,
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

/// Setup's backups are plain files it created itself; anything else at that name
/// (a link someone planted in a directory they may write) is neither read nor
/// written through.
fn not_a_backup(backup: &Path) -> SetupError {
    SetupError::Io {
        what: "use the backup",
        path: backup.to_owned(),
        reason: "it is not a plain file (a symbolic link?); setup only keeps backups it \
                 created as plain files: remove it, then run setup again"
            .into(),
    }
}

/// The original, once: a second setup after a change of path keeps the first.
/// Created exclusively (`O_EXCL`), so a link planted at the name is never followed.
fn write_backup(backup: &Path, original: &str) -> Result<(), SetupError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(backup);
    match created {
        Ok(mut file) => file
            .write_all(original.as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(io_error("write the backup", backup)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            match std::fs::symlink_metadata(backup) {
                Ok(meta) if meta.file_type().is_file() => Ok(()),
                _ => Err(not_a_backup(backup)),
            }
        }
        Err(e) => Err(io_error("write the backup", backup)(e)),
    }
}

/// The backup, if there is one; never through a link (`O_NOFOLLOW`).
fn read_backup(backup: &Path) -> Result<Option<String>, SetupError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(backup);
    let mut file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(not_a_backup(backup)),
        Err(e) => return Err(io_error("read", backup)(e)),
    };
    if !file.metadata().map_err(io_error("read", backup))?.is_file() {
        return Err(not_a_backup(backup));
    }
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(io_error("read", backup))?;
    Ok(Some(text))
}

/// Writes `file` (never a link: see [`edited_file`]) through a fresh temporary file
/// in its directory, renamed over it, keeping the old file's permissions: the engine
/// never reads half a file. The temporary file gets a random name and is created
/// exclusively, so nothing planted in the directory is written or chmodded through.
fn write_atomically(file: &Path, text: &str) -> Result<(), SetupError> {
    use std::io::Write as _;
    use std::os::unix::fs::PermissionsExt;
    let dir = match file.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => dir,
        None => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(io_error("create the directory of", file))?;
    let mode = std::fs::metadata(file)
        .map(|m| m.permissions().mode())
        .unwrap_or(0o644);
    let mut tmp = tempfile::Builder::new()
        .prefix(".gpushare-setup-")
        .tempfile_in(dir)
        .map_err(io_error("create a temporary file beside", file))?;
    tmp.write_all(text.as_bytes())
        .and_then(|()| {
            tmp.as_file()
                .set_permissions(std::fs::Permissions::from_mode(mode))
        })
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(io_error("write a temporary file beside", file))?;
    tmp.persist(file)
        .map_err(|e| io_error("replace", file)(e.error))?;
    Ok(())
}

/// Configures (or with `undo`, unconfigures) the engine's file at `path`. With `dry_run`
/// nothing is written; the outcome says what would be.
pub fn apply(
    engine: Engine,
    path: &Path,
    programs: &Programs,
    undo_it: bool,
    dry_run: bool,
) -> Result<Outcome, SetupError> {
    let file = edited_file(path)?;
    let current = read_optional(&file)?;
    let backup_file = backup_path(&file);
    let outcome = |action, content| Outcome {
        engine,
        path: path.to_owned(),
        action,
        content,
    };
    if !undo_it {
        let text = current.clone().unwrap_or_default();
        let edited = configure(engine, &text, programs)?;
        if current.is_some() && edited == text {
            return Ok(outcome(Action::Unchanged, Some(edited)));
        }
        if !dry_run {
            if let Some(original) = &current {
                write_backup(&backup_file, original)?;
            }
            write_atomically(&file, &edited)?;
        }
        return Ok(outcome(Action::Written, Some(edited)));
    }

    let Some(text) = current else {
        return Ok(outcome(Action::Unchanged, None));
    };
    let backup = read_backup(&backup_file)?;
    let restored = undo(engine, &text, backup.as_deref(), programs)?;
    if restored.as_deref() == Some(text.as_str()) {
        return Ok(outcome(Action::Unchanged, restored));
    }
    if !dry_run {
        match &restored {
            Some(content) => write_atomically(&file, content)?,
            None => std::fs::remove_file(&file).map_err(io_error("remove", &file))?,
        }
        if backup.is_some() {
            std::fs::remove_file(&backup_file).map_err(io_error("remove", &backup_file))?;
        }
    }
    let action = if restored.is_some() {
        Action::Restored
    } else {
        Action::Removed
    };
    Ok(outcome(action, restored))
}

#[cfg(test)]
mod tests;
