#!/usr/bin/env bash
# make gpu-check: the real-GPU compatibility matrix (tests/bench/src/gpu_check). The program
# decides everything: whether there is a driver (libcuda.so.1 and NVML answer, else one line
# and exit 0), which binaries it checks, each step's timeout, the results
# (tests/bench/results/gpu-check.{md,json}, rewritten after every step). This only finds it:
# in GPUSHARE_BIN_DIR (binaries built elsewhere, for a GPU machine without cargo or a
# registry), else built here in release. Arguments go to the program (e.g. --steps probe-alone).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GPUSHARE_BIN_DIR:-}" ]; then
  program=$GPUSHARE_BIN_DIR/gpushare-gpu-check
elif command -v cargo >/dev/null 2>&1; then
  cargo build --release --quiet -p gpushare-bench --bin gpushare-gpu-check
  program=$PWD/target/release/gpushare-gpu-check
else
  echo "gpu-check: cargo is not here to build gpushare-gpu-check; set GPUSHARE_BIN_DIR to a directory of binaries built elsewhere (see docs/development.md)" >&2
  exit 1
fi
exec "$program" "$@"
