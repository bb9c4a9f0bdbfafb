#!/usr/bin/env bash
# make gpu-check: runs gpushare's checks on a real NVIDIA GPU (the probe, a memory
# quota, CUDA graph capture across the token agent's drains, 2 s kernels beside a
# high-priority job, the priority pair; PyTorch's graph capture where torch is
# installed) and writes tests/bench/results/gpu-check.{md,json}.
#
# Without an NVIDIA driver it says so and exits 0, before building anything: CI and
# development machines have no GPU. It needs no package registry: on a GPU machine
# without cargo, point GPUSHARE_BIN_DIR at a directory holding gpushare-arbiter,
# gpushare-cuda-probe, simgpu-workload, gpushare-gpu-check and libgpushare.so built
# elsewhere (GPUSHARE_PRELOAD_LIB for the library if it lives apart).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -e /proc/driver/nvidia/version ]; then
  echo "gpu-check: no NVIDIA driver on this machine (/proc/driver/nvidia/version is absent); nothing to check"
  exit 0
fi
bin_dir=${GPUSHARE_BIN_DIR:-$PWD/target/debug}
if [ ! -x "$bin_dir/gpushare-gpu-check" ]; then
  if ! command -v cargo >/dev/null 2>&1; then
    echo "gpu-check: $bin_dir/gpushare-gpu-check is missing and cargo is not here to build it; set GPUSHARE_BIN_DIR" >&2
    exit 1
  fi
  make build
  cargo build -p gpushare-bench --bin gpushare-gpu-check
fi
GPUSHARE_BIN_DIR=$bin_dir exec "$bin_dir/gpushare-gpu-check" "${1:-$PWD/tests/bench/results/gpu-check.md}"
