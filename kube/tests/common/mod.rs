//! What gpushare-kube's tests and benchmark share: a node of a real arbiter
//! (declared GPUs), the real plugin binary and the test kubelet (tests/cri) on
//! one private directory.

#![allow(dead_code)] // Each user takes the part it needs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpushare_cri::kubelet::TestKubelet;
use gpushare_proto::grant::Grant;
use gpushare_testkit::config::KubernetesConfig;
use gpushare_testkit::{binaries, Arbiter};
use gpushare_types::kubernetes::{COMPUTE_RESOURCE, HIGH_RESOURCE, MEMORY_RESOURCE};

pub const GIB: u64 = 1 << 30;
/// Generous: a loaded 2-core machine runs several suites at once.
pub const WAIT: Duration = Duration::from_secs(20);

/// An arbiter, the plugin and the test kubelet on one private directory.
pub struct Node {
    pub kubelet: TestKubelet,
    plugin: Child,
    plugin_log: PathBuf,
    pub arbiter: Arbiter,
}

impl Node {
    pub fn start(gpus: u32, memory: &str, edit: impl FnOnce(&mut KubernetesConfig)) -> Node {
        Node::start_logging(gpus, memory, "debug,h2=info,tower=info,hyper=info", edit)
    }

    /// `log`: the arbiter's and the plugin's `GPUSHARE_LOG`.
    pub fn start_logging(
        gpus: u32,
        memory: &str,
        log: &str,
        edit: impl FnOnce(&mut KubernetesConfig),
    ) -> Node {
        binaries::cargo_build(&["gpushare-arbiter"]);
        binaries::require(&["gpushare-arbiter", "gpushare-kube"]);
        let arbiter = Arbiter::builder()
            .declared_gpus(gpus, memory)
            .env("GPUSHARE_LOG", log)
            .start();
        let dir = arbiter.dir().to_owned();
        let plugin_dir = dir.join("device-plugins");
        std::fs::create_dir_all(&plugin_dir).unwrap();
        let mut config = arbiter.config().clone();
        config.kubernetes.device_plugin_dir = plugin_dir.clone();
        config.kubernetes.pod_resources_socket = dir.join("pod-resources.sock");
        config.kubernetes.poll_interval_ms = 50;
        // Collection only where a test asks for it.
        config.kubernetes.collect_interval_ms = 3_600_000;
        edit(&mut config.kubernetes);
        let kubelet = TestKubelet::start(&plugin_dir, &config.kubernetes.pod_resources_socket);
        let config_path = dir.join("kube.toml");
        std::fs::write(&config_path, config.to_toml().unwrap()).unwrap();
        let plugin_log = dir.join("gpushare-kube.log");
        let log_file = std::fs::File::create(&plugin_log).unwrap();
        let plugin = Command::new(binaries::program("gpushare-kube"))
            .arg("--config")
            .arg(&config_path)
            .env("GPUSHARE_LOG", log)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start gpushare-kube");
        let node = Node {
            kubelet,
            plugin,
            plugin_log,
            arbiter,
        };
        for resource in [MEMORY_RESOURCE, HIGH_RESOURCE, COMPUTE_RESOURCE] {
            node.kubelet
                .wait_registered(resource, WAIT)
                .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", node.plugin_log()));
        }
        node
    }

    pub fn plugin_log(&self) -> String {
        std::fs::read_to_string(&self.plugin_log).unwrap_or_default()
    }

    pub fn wait_healthy(&self, resource: &str, healthy: usize) {
        self.kubelet
            .wait_for_resource(resource, healthy, WAIT)
            .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", self.plugin_log()));
    }

    pub fn grants(&self) -> Vec<Grant> {
        self.arbiter.client().grants().unwrap()
    }

    pub fn grant(&self, id: &str) -> Option<Grant> {
        self.grants().into_iter().find(|g| g.id.0 == id)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.plugin.kill();
        let _ = self.plugin.wait();
    }
}

pub fn plugin_dir(node: &Node) -> &Path {
    node.kubelet.plugin_dir()
}
