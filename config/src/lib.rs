//! The one configuration file every gpushare component reads:
//! `/etc/gpushare/config.toml`, or the file named by `GPUSHARE_CONFIG`.
//!
//! Every field has a default, so a node works with no file at all. Unknown keys
//! and wrong types are errors that name the key and the file: a typo in a
//! production node's configuration must not silently fall back to a default.

use std::path::{Path, PathBuf};

use gpushare_proto::ByteSize;
use serde::Deserialize;

pub const DEFAULT_PATH: &str = "/etc/gpushare/config.toml";
/// Read from the environment of the *runtime* process (dockerd, containerd, the
/// test harness), never from a container's spec.
pub const PATH_ENV: &str = "GPUSHARE_CONFIG";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read gpushare configuration {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid gpushare configuration {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub arbiter: ArbiterConfig,
    pub requests: RequestPolicy,
    pub runtime: RuntimeConfig,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ArbiterConfig {
    /// Holds the control socket and one directory per lease (mounted into that
    /// container as /run/gpushare). A tmpfs: it is rebuilt from `state_dir` after a reboot.
    pub run_dir: PathBuf,
    /// Durable lease records. Must survive an arbiter restart.
    pub state_dir: PathBuf,
    /// Root-only control socket; default `<run_dir>/control.sock`.
    pub control_socket: Option<PathBuf>,
    /// GPUs to use when NVML cannot be loaded (no driver, or the simulated GPU in tests).
    pub devices: Vec<DeclaredDevice>,
    /// UUIDs of the GPUs gpushare may hand out; empty means all of them.
    pub shared_gpus: Vec<String>,
    /// Memory quota for a container that asks for a share but names no amount.
    /// A quarter of the GPU keeps four default-sized jobs per GPU, the paper's low-priority cap.
    pub default_memory: gpushare_proto::MemoryRequest,
    /// How long the client tools wait for the arbiter before failing a container start.
    pub client_timeout_ms: u64,
}

impl Default for ArbiterConfig {
    fn default() -> Self {
        ArbiterConfig {
            run_dir: PathBuf::from("/run/gpushare"),
            state_dir: PathBuf::from("/var/lib/gpushare"),
            control_socket: None,
            devices: Vec::new(),
            shared_gpus: Vec::new(),
            default_memory: gpushare_proto::MemoryRequest::Fraction(
                gpushare_proto::Fraction::new(0.25).expect("0.25 is a fraction"),
            ),
            client_timeout_ms: 10_000,
        }
    }
}

impl ArbiterConfig {
    pub fn control_socket(&self) -> PathBuf {
        self.control_socket
            .clone()
            .unwrap_or_else(|| self.run_dir.join("control.sock"))
    }

    /// The directory a lease's container sees as /run/gpushare.
    pub fn lease_dir(&self, lease: &gpushare_proto::LeaseId) -> PathBuf {
        self.run_dir.join("leases").join(&lease.0)
    }

    pub fn client_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.client_timeout_ms)
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeclaredDevice {
    pub uuid: String,
    #[serde(default = "DeclaredDevice::default_name")]
    pub name: String,
    pub memory: ByteSize,
}

impl DeclaredDevice {
    fn default_name() -> String {
        "declared GPU".to_string()
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Unrequested {
    /// Pass the container through unchanged, so gpushare can be a node's default runtime.
    #[default]
    Untouched,
    /// Force `NVIDIA_VISIBLE_DEVICES=void`, so images that bake in `=all` see no GPU.
    Void,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RequestPolicy {
    /// Accept `GPUSHARE_*` environment variables as requests (docker 20.10 has no annotations).
    pub accept_env: bool,
    pub unrequested: Unrequested,
    /// Tenants allowed to ask for high priority; `None` (the key absent) allows everyone.
    pub high_priority_tenants: Option<Vec<String>>,
}

impl Default for RequestPolicy {
    fn default() -> Self {
        RequestPolicy {
            accept_env: true,
            unrequested: Unrequested::Untouched,
            high_priority_tenants: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// The runtime `gpushare-runc` hands over to: the first one found. The NVIDIA
    /// runtime comes first so device nodes and driver libraries are still injected.
    pub runtimes: Vec<String>,
    /// Where the interposer lives on the host.
    pub library: PathBuf,
    /// Where it appears inside containers (bind-mounted read-only).
    pub container_library: PathBuf,
    /// Absolute path of gpushare-hook, written into each spec's hooks.
    pub hook: PathBuf,
    /// runc runs hooks without any timeout unless the spec sets one.
    pub hook_timeout_seconds: u32,
    /// Also mount an /etc/ld.so.preload naming the library: covers entrypoints
    /// that reset the environment and exec sessions (glibc only).
    pub ld_so_preload: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            runtimes: vec![
                "nvidia-container-runtime".into(),
                "runc".into(),
                "crun".into(),
            ],
            library: PathBuf::from("/usr/local/lib/gpushare/libgpushare.so"),
            container_library: PathBuf::from("/usr/local/gpushare/libgpushare.so"),
            hook: PathBuf::from("/usr/local/bin/gpushare-hook"),
            hook_timeout_seconds: 10,
            ld_so_preload: false,
        }
    }
}

impl Config {
    /// The file named by `GPUSHARE_CONFIG`, else `/etc/gpushare/config.toml`;
    /// a missing default file means all defaults, a missing named file is an error.
    pub fn load_default() -> Result<(Config, Option<PathBuf>), ConfigError> {
        match std::env::var_os(PATH_ENV) {
            Some(path) => {
                let path = PathBuf::from(path);
                Ok((Config::load(&path)?, Some(path)))
            }
            None => Config::load_if_present(Path::new(DEFAULT_PATH)),
        }
    }

    pub fn load_if_present(path: &Path) -> Result<(Config, Option<PathBuf>), ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok((Config::parse(&text, path)?, Some(path.to_owned()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Config::default(), None)),
            Err(source) => Err(ConfigError::Read {
                path: path.to_owned(),
                source,
            }),
        }
    }

    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Invalid {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        config.validate().map_err(|message| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        })?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        for (key, path) in [
            ("runtime.library", &self.runtime.library),
            ("runtime.container_library", &self.runtime.container_library),
            ("runtime.hook", &self.runtime.hook),
            ("arbiter.run_dir", &self.arbiter.run_dir),
            ("arbiter.state_dir", &self.arbiter.state_dir),
        ] {
            if !path.is_absolute() {
                return Err(format!("{key} = {path:?}: must be an absolute path"));
            }
        }
        if self.runtime.runtimes.is_empty() {
            return Err(
                "runtime.runtimes = []: name at least one OCI runtime (e.g. \"runc\")".into(),
            );
        }
        if self.runtime.hook_timeout_seconds == 0 {
            return Err("runtime.hook_timeout_seconds = 0: must be at least 1 (runc would otherwise wait forever)".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for d in &self.arbiter.devices {
            if !seen.insert(&d.uuid) {
                return Err(format!(
                    "arbiter.devices: uuid {:?} is declared twice",
                    d.uuid
                ));
            }
            if d.memory.0 == 0 {
                return Err(format!(
                    "arbiter.devices: device {:?} has memory = 0",
                    d.uuid
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("/etc/gpushare/config.toml"))
    }

    #[test]
    fn empty_file_is_all_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
        assert_eq!(
            Config::default().arbiter.control_socket(),
            PathBuf::from("/run/gpushare/control.sock")
        );
    }

    #[test]
    fn shipped_example_parses_and_matches_defaults_where_it_says_so() {
        let text = include_str!("../config.toml");
        let config = parse(text).unwrap();
        assert_eq!(config.runtime, RuntimeConfig::default());
        assert_eq!(config.requests, RequestPolicy::default());
    }

    #[test]
    fn unknown_key_names_the_key_and_file() {
        let err = parse("[arbiter]\nrun_dri = \"/run/x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("run_dri"), "{err}");
        assert!(err.contains("/etc/gpushare/config.toml"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_key_and_file() {
        let err = parse("[requests]\naccept_env = \"yes\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("accept_env"), "{err}");
        assert!(err.contains("/etc/gpushare/config.toml"), "{err}");
        let err = parse("[[arbiter.devices]]\nuuid = \"GPU-x\"\nmemory = \"lots\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("memory") && err.contains("lots"), "{err}");
    }

    #[test]
    fn declared_devices_and_units() {
        let config = parse(
            "[[arbiter.devices]]\nuuid = \"GPU-51a6d0e0-0000-4000-8000-000000000000\"\nmemory = \"16Gi\"\n\
             [[arbiter.devices]]\nuuid = \"GPU-51a6d0e0-0000-4000-8000-000000000001\"\nname = \"sim\"\nmemory = 1024\n",
        )
        .unwrap();
        assert_eq!(config.arbiter.devices[0].memory, ByteSize(16 << 30));
        assert_eq!(config.arbiter.devices[1].memory, ByteSize(1024));
        assert_eq!(config.arbiter.devices[1].name, "sim");
    }

    #[test]
    fn semantic_errors_name_the_key() {
        for (text, key) in [
            ("[runtime]\nlibrary = \"lib.so\"\n", "runtime.library"),
            ("[runtime]\nruntimes = []\n", "runtime.runtimes"),
            (
                "[runtime]\nhook_timeout_seconds = 0\n",
                "runtime.hook_timeout_seconds",
            ),
            ("[requests]\nunrequested = \"drop\"\n", "unrequested"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text:?}: {err}");
        }
    }

    #[test]
    fn missing_default_file_means_defaults_but_a_named_missing_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (config, used) = Config::load_if_present(&dir.path().join("absent.toml")).unwrap();
        assert_eq!(config, Config::default());
        assert!(used.is_none());
        assert!(Config::load(&dir.path().join("absent.toml")).is_err());
    }
}

/// The ready-made snippets users copy must stay well-formed and agree with the
/// defaults (install paths, runtime name, annotation patterns).
#[cfg(test)]
mod snippet_tests {
    use std::path::Path;

    fn read(rel: &str) -> String {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
    }

    #[test]
    fn containerd_snippets() {
        for (file, plugin) in [
            ("containerd/config-v2.toml", "io.containerd.grpc.v1.cri"),
            ("containerd/config-v3.toml", "io.containerd.cri.v1.runtime"),
        ] {
            let doc: toml::Value = toml::from_str(&read(file)).unwrap();
            let runtime = &doc["plugins"][plugin]["containerd"]["runtimes"]["gpushare"];
            assert_eq!(
                runtime["pod_annotations"][0].as_str(),
                Some("gpushare.io/*"),
                "{file}"
            );
            assert_eq!(
                runtime["container_annotations"][0].as_str(),
                Some("gpushare.io/*"),
                "{file}"
            );
            assert_eq!(
                runtime["options"]["BinaryName"].as_str(),
                Some("/usr/local/bin/gpushare-runc"),
                "{file}"
            );
        }
    }

    #[test]
    fn docker_and_hook_snippets() {
        let d20: serde_json::Value =
            serde_json::from_str(&read("docker/daemon-20.10.json")).unwrap();
        assert_eq!(
            d20["runtimes"]["gpushare"]["path"],
            "/usr/local/bin/gpushare-runc"
        );
        let d24: serde_json::Value = serde_json::from_str(&read("docker/daemon-24.json")).unwrap();
        assert_eq!(
            d24["runtimes"]["gpushare"]["options"]["BinaryName"],
            "/usr/local/bin/gpushare-runc"
        );
        let hook: serde_json::Value = serde_json::from_str(&read("hooks.d/gpushare.json")).unwrap();
        assert_eq!(
            hook["hook"]["path"],
            crate::RuntimeConfig::default().hook.to_str().unwrap()
        );
        assert!(
            hook["hook"]["timeout"].as_u64().unwrap() > 0,
            "runc-style hooks need a timeout"
        );
    }

    #[test]
    fn kubernetes_snippets_name_the_runtime() {
        assert!(read("kubernetes/runtimeclass.yaml").contains("handler: gpushare"));
        let pod = read("kubernetes/pod.yaml");
        assert!(pod.contains("runtimeClassName: gpushare") && pod.contains("gpushare.io/memory"));
    }
}
