//! One test kit for every suite and benchmark: a private arbiter, simgpu, and the shared helpers.

pub mod fake_arbiter;
