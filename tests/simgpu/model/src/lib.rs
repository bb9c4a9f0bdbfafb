//! The device model behind the simulated NVIDIA GPU (`libcuda.so.1`, `libnvidia-ml.so.1`).
//!
//! Every process on the machine maps one state file under `SIMGPU_DIR` and advances the model
//! lazily: each operation first brings the device from its last update time to "now" with the
//! pure time-slicing rules of [`timeslice`], so completion times are exact and nothing depends on
//! a thread waking up on time. Everything measured on it is *simulated*.

pub mod checkpoint;
pub mod clock;
pub mod config;
pub mod contents;
pub mod device;
pub mod kernel;
pub mod liveness;
pub mod lock;
pub mod pidns;
pub mod shared;
pub mod timeslice;

pub use clock::now_ns;
pub use config::SimConfig;
pub use device::{Device, DeviceError};

/// The deterministic UUID of simulated GPU `index`, so configuration files can name it.
pub fn gpu_uuid(index: u32) -> String {
    format!("GPU-51a6d0e0-0000-4000-8000-{:012x}", index)
}

/// The 16 raw bytes behind [`gpu_uuid`], as `cuDeviceGetUuid` returns them.
pub fn gpu_uuid_bytes(index: u32) -> [u8; 16] {
    let mut bytes = [
        0x51, 0xa6, 0xd0, 0xe0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0,
    ];
    let tail = (index as u64).to_be_bytes();
    bytes[10..16].copy_from_slice(&tail[2..8]);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_string_and_bytes_agree() {
        for i in [0u32, 1, 7, 0xabcdef] {
            let text = gpu_uuid(i);
            let hex: String = gpu_uuid_bytes(i)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(text.replace('-', "").trim_start_matches("GPU"), hex);
        }
        assert_eq!(gpu_uuid(1), "GPU-51a6d0e0-0000-4000-8000-000000000001");
    }
}
