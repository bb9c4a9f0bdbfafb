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
  for c in demo-high demo-low; do ctr -a "$work/containerd.sock" task kill -s KILL "$c" >/dev/null 2>&1; ctr -a "$work/containerd.sock" container rm "$c" >/dev/null 2>&1; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  grep -o " $work/[^ ]*" /proc/self/mounts | sort -r | xargs -r -n1 umount -l
  rm -rf "$work"
}
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# --- GPUs: the real ones when an NVIDIA driver answers, simulated ones otherwise.
devices=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA driver found: sharing the real GPUs"
  while IFS=, read -r uuid name mem; do
    devices+=$'\n'"[[arbiter.devices]]"$'\n'"uuid = \"${uuid// /}\""$'\n'"name = \"${name# }\""$'\n'"memory = \"${mem// /}Mi\""$'\n'
  done < <(nvidia-smi --query-gpu=uuid,name,memory.total --format=csv,noheader,nounits)
else
  say "No NVIDIA driver: sharing 2 simulated GPUs (every figure below is simulated)"
  for i in 0 1; do
    devices+=$'\n'"[[arbiter.devices]]"$'\n'"uuid = \"GPU-51a6d0e0-0000-4000-8000-00000000000$i\""$'\n'"name = \"simulated GPU $i\""$'\n'"memory = \"16Gi\""$'\n'
  done
fi

cat > "$work/config.toml" <<TOML
[arbiter]
run_dir = "$work/run"
state_dir = "$work/state"

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
  mkdir -p "$1/bin" "$1/proc" "$1/sys" "$1/dev" "$1/etc" "$1/tmp" "$1/run"
  cp /bin/busybox "$1/bin/"
  for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -sf busybox "$1/bin/$a"; done
}
make_rootfs "$work/rootfs-high"
make_rootfs "$work/rootfs-low"

show='echo "[$GPUSHARE_QUOTA_PRIORITY] GPU $NVIDIA_VISIBLE_DEVICES, memory quota $GPUSHARE_QUOTA_MEMORY bytes, lease $GPUSHARE_LEASE, LD_PRELOAD=$LD_PRELOAD"; ls /run/gpushare >/dev/null && echo "[$GPUSHARE_QUOTA_PRIORITY] lease directory mounted at /run/gpushare"; sleep 2'
run() { # name priority memory
  ctr -a "$work/containerd.sock" run --rm --rootfs --runc-binary "$BIN/gpushare-runc" \
    --env PATH=/bin --annotation gpushare.io/gpu=index:0 \
    --annotation "gpushare.io/priority=$2" --annotation "gpushare.io/memory=$3" \
    "$work/rootfs-$2" "$1" /bin/sh -c "$show"
}

say "Running a high-priority (4Gi) and a low-priority (25%) container, both on GPU 0"
run demo-high high 4Gi &
high=$!
sleep 0.5
run demo-low low 25% &
low=$!
sleep 1
say "gpusharectl status while both run"
"$BIN/gpusharectl" status
wait $high $low
say "gpusharectl status after both exited (their leases are released)"
"$BIN/gpusharectl" status
