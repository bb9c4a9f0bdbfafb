//! gpushare-bench: the compute-isolation experiments on the simulated GPU. A private
//! arbiter per case, one lease per job reserved through the control socket, `simgpu-workload`
//! processes under the interposer; results as JSON and Markdown. Every figure is simulated.

pub mod cluster;
pub mod control_path;
pub mod e1;
pub mod e2_mixed;
pub mod e3;
pub mod experiment;
pub mod gpu_check;
pub mod kube_sim;
pub mod liars;
pub mod metrics;
pub mod plot;
pub mod profiles;
pub mod reclaim;
pub mod report;
pub mod scaling;
pub mod setup;
pub mod tgs;
