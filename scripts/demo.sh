#!/usr/bin/env bash
# make demo: a high- and a low-priority container share one GPU through real
# containerd + runc, with gpushare-runc as the runc binary. Everything runs in a
# private directory with a private containerd; nothing on the host is touched.
set -euo pipefail

BIN=${GPUSHARE_BIN_DIR:?set by make}
if [ "$(id -u)" -ne 0 ]; then echo "make demo needs root (it runs containers)" >&2; exit 1; fi

work=$(mktemp -d /tmp/gpushare-demo.XXXXXX)
pids=()
cleanup() {
  set +e
  for c in demo-alone demo-high demo-low; do ctr -a "$work/containerd.sock" task kill -s KILL "$c" >/dev/null 2>&1; ctr -a "$work/containerd.sock" container rm "$c" >/dev/null 2>&1; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  grep -o " $work/[^ ]*" /proc/self/mounts | sort -r | xargs -r -n1 umount -l
  rm -rf "$work"
}
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# --- GPUs: the real ones when an NVIDIA driver answers, simulated ones otherwise.
devices=""
simulated=""
nvml=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA driver found: sharing the real GPUs"
  while IFS=, read -r uuid name mem; do
    devices+=$'\n'"[[arbiter.devices]]"$'\n'"uuid = \"${uuid// /}\""$'\n'"name = \"${name# }\""$'\n'"memory = \"${mem// /}Mi\""$'\n'
  done < <(nvidia-smi --query-gpu=uuid,name,memory.total --format=csv,noheader,nounits)
else
  say "No NVIDIA driver: sharing 2 simulated GPUs (every figure below is simulated)"
  simulated=1
  mkdir -p "$work/simgpu-lib" "$work/simgpu"
  "$(dirname "$0")/../tests/simgpu/install.sh" "$work/simgpu-lib" "$(basename "$BIN")" >/dev/null
  # The arbiter takes its inventory, utilisation and process list through the simulated
  # GPU's NVML: the same code path as on a real node.
  nvml="nvml_library = \"$work/simgpu-lib/libnvidia-ml.so.1\""
  export SIMGPU_DIR="$work/simgpu" SIMGPU_GPUS=2 SIMGPU_MEMORY=16Gi
  for i in 0 1; do
    devices+=$'\n'"[[arbiter.devices]]"$'\n'"uuid = \"GPU-51a6d0e0-0000-4000-8000-00000000000$i\""$'\n'"name = \"simulated GPU $i\""$'\n'"memory = \"16Gi\""$'\n'
  done
fi

cat > "$work/config.toml" <<TOML
[arbiter]
run_dir = "$work/run"
state_dir = "$work/state"
$nvml

[runtime]
runtimes = ["nvidia-container-runtime", "runc"]
library = "$BIN/libgpushare.so"
hook = "$BIN/gpushare-hook"
$devices
TOML
export GPUSHARE_CONFIG="$work/config.toml"

say "Starting gpushare-arbiter"
"$BIN/gpushare-arbiter" >"$work/arbiter.log" 2>&1 &
pids+=($!)

cat > "$work/containerd.toml" <<TOML
version = 2
root = "$work/containerd-root"
state = "$work/containerd-state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$work/containerd.sock"
TOML
say "Starting a private containerd ($(containerd --version | awk '{print $3}'))"
containerd --config "$work/containerd.toml" >"$work/containerd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  [ -S "$work/run/control.sock" ] && ctr -a "$work/containerd.sock" version >/dev/null 2>&1 && break
  sleep 0.1
done

make_rootfs() {
  mkdir -p "$1/bin" "$1/proc" "$1/sys" "$1/dev" "$1/etc" "$1/tmp" "$1/run" "$1/opt/simgpu/lib"
  cp /bin/busybox "$1/bin/"
  for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -sf busybox "$1/bin/$a"; done
  if [ -n "$simulated" ]; then
    # What the NVIDIA toolkit would inject on a real node: the driver libraries.
    # The workload and the libraries are glibc programs: bring their dependencies.
    cp "$BIN/simgpu-workload" "$1/bin/"
    cp -L "$work/simgpu-lib/libcuda.so.1" "$work/simgpu-lib/libnvidia-ml.so.1" "$1/opt/simgpu/lib/"
    for f in "$BIN/simgpu-workload" "$work/simgpu-lib/libcuda.so.1" "$work/simgpu-lib/libnvidia-ml.so.1" "$BIN/libgpushare.so"; do
      ldd "$f" | grep -o '/[^ ]*' | while read -r lib; do cp -L --parents "$lib" "$1/"; done
    done
  fi
}
make_rootfs "$work/rootfs-high"
make_rootfs "$work/rootfs-low"

# A training-like job: bursts of 50 kernels of ~100 us with CPU gaps (about 60 % busy alone),
# and a saturating one (100 us kernels: a preempted job drains in about one kernel). Durations
# are wall-clock time on the simulated GPU.
high_job="simgpu-workload --kernels 50 --kernel lognormal:100us:0.3 --gap 3300us --duration 4s --memory 2Gi"
low_job="simgpu-workload --kernels 20 --kernel fixed:100us --gap 0 --duration 4s --memory 2Gi"
show='echo "[$GPUSHARE_QUOTA_PRIORITY] GPU $NVIDIA_VISIBLE_DEVICES, memory quota $GPUSHARE_QUOTA_MEMORY bytes, lease $GPUSHARE_LEASE, LD_PRELOAD=$LD_PRELOAD"'
run() { # name priority memory command
  local mounts=()
  if [ -n "$simulated" ]; then
    mounts=(--mount "type=bind,src=$work/simgpu,dst=/run/simgpu,options=rbind:rw" --env LD_LIBRARY_PATH=/opt/simgpu/lib)
  fi
  ctr -a "$work/containerd.sock" run --rm --rootfs --runc-binary "$BIN/gpushare-runc" \
    --env PATH=/bin "${mounts[@]}" --annotation gpushare.io/gpu=index:0 \
    --annotation "gpushare.io/priority=$2" --annotation "gpushare.io/memory=$3" \
    "$work/rootfs-$2" "$1" /bin/sh -c "$show; $4"
}
summary() { # label json-line
  # The iteration time is the period from one iteration's start to the next (kernels and CPU
  # gap); the report's other distributions (latency_ms, start_latency_us) have p50/p99 too.
  local it period p50 p99
  it=$(printf '%s' "$2" | grep -o '"throughput_iters_per_s":[0-9.]*' | cut -d: -f2)
  period=$(printf '%s' "$2" | grep -o '"period_ms":{[^}]*}')
  p50=$(printf '%s' "$period" | grep -o '"p50":[0-9.]*' | cut -d: -f2)
  p99=$(printf '%s' "$period" | grep -o '"p99":[0-9.]*' | cut -d: -f2)
  printf '  %-34s %8.1f iterations/s   iteration p50 %6.2f ms   p99 %6.2f ms\n' "$1" "$it" "${p50:-0}" "${p99:-0}"
}

if [ -n "$simulated" ]; then
  say "Baseline: the high-priority job alone on GPU 0"
  alone=$(run demo-alone high 4Gi "$high_job" | tee /dev/stderr | grep '^{' || true)
fi

say "A high-priority (4Gi) and a low-priority (25%) container, both on GPU 0"
if [ -z "$simulated" ]; then high_job="sleep 3"; low_job="sleep 3"; fi
run demo-high high 4Gi "$high_job" >"$work/high.out" &
high=$!
sleep 0.5
run demo-low low 25% "$low_job" >"$work/low.out" &
low=$!
sleep 1.5
say "gpusharectl status while both run"
"$BIN/gpusharectl" status
wait $high $low
grep -v '^{' "$work/high.out" "$work/low.out" | sed 's/^[^:]*://'

if [ -n "$simulated" ]; then
  say "What each job got (simulated GPU)"
  summary "high priority, alone" "$alone"
  summary "high priority, sharing" "$(grep '^{' "$work/high.out")"
  summary "low priority, sharing" "$(grep '^{' "$work/low.out")"
  cat <<'NOTE'
  libgpushare.so enforces each container's memory quota (see "used" in the status above) and
  gates kernel launches on the GPU's time-slice token (TOKENS in the status): the high-priority
  job takes it whenever it has work, and the low-priority job runs in the time it leaves idle.
  Without the token the GPU would time-slice between them like the hardware, and the
  high-priority job's iterations would take about 70 % longer (tests/bench/results).
NOTE
fi

# One watchdog pass (every 2 s) so the status no longer lists the exited processes.
sleep 2.5
say "gpusharectl status after both exited (their leases are released)"
"$BIN/gpusharectl" status
