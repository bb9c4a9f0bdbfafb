#!/usr/bin/env bash
# make demo: a high- and a low-priority container share one GPU through a real containerd and
# runc, the way an installed node runs them. gpushare is installed into a temporary prefix
# exactly as `make install` lays out a node (scripts/install-files.sh: programs in bin/, the
# interposer in lib/gpushare/, the shipped configuration in etc/gpushare/config.toml), and
# the containers start through the installed shim, `ctr run --runtime io.containerd.gpushare.v2`,
# which a private containerd finds on its PATH. Nothing on the host is touched.
# What it shows is kept in target/demo (GPUSHARE_DEMO_DIR): the timeline chart (timeline.svg),
# each job's report, gpusharectl's views and the arbiter's log.
set -euo pipefail

BIN=${GPUSHARE_BIN_DIR:?set by make: the built programs and libgpushare.so}
MAN_DIR=${GPUSHARE_MAN_DIR:?set by make: the man pages make man wrote}
COMPLETIONS_DIR=${GPUSHARE_COMPLETIONS_DIR:?set by make: the completions make man wrote}
if [ "$(id -u)" -ne 0 ]; then echo "make demo needs root (it runs containers)" >&2; exit 1; fi
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${GPUSHARE_DEMO_DIR:-$repo/target/demo}
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.out "$out"/*.txt "$out"/*.svg "$out"/arbiter.log "$out"/config.toml

work=$(mktemp -d /tmp/gpushare-demo.XXXXXX)
prefix=$work/prefix
etc=$work/etc
pids=()
cleanup() {
  set +e
  for c in demo-high-alone demo-low-alone demo-high demo-low; do ctr -a "$work/containerd.sock" task kill -s KILL "$c" >/dev/null 2>&1; ctr -a "$work/containerd.sock" container rm "$c" >/dev/null 2>&1; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  cp "$work/arbiter.log" "$out/arbiter.log" 2>/dev/null
  grep -o " $work/[^ ]*" /proc/self/mounts | sort -r | xargs -r -n1 umount -l
  rm -rf "$work"
}
trap cleanup EXIT

# Bold headings on a terminal only: a file (make demo > demo.txt) gets plain text.
if [ -t 1 ]; then bold=$'\033[1m' plain=$'\033[0m'; else bold="" plain=""; fi
say() { printf '\n%s== %s%s\n' "$bold" "$*" "$plain"; }
# A paragraph of explanation under a heading, indented.
explain() { fold -s -w 96 | sed -e 's/ *$//' -e '/./s/^/  /'; }

# 4294967296 -> "4 GiB", 2464153600 -> "2.3 GiB", 524288000 -> "500 MiB".
human_bytes() {
  awk -v b="$1" 'BEGIN {
    if (b >= 1073741824) { s = sprintf("%.1f", b / 1073741824); sub(/\.0$/, "", s); print s " GiB" }
    else if (b >= 1048576) printf "%.0f MiB\n", b / 1048576
    else printf "%d bytes\n", b }'
}

say "Installing gpushare into a temporary prefix, laid out as make install lays out a node"
PREFIX=$prefix SYSCONFDIR=$etc UNITDIR=$etc/systemd/system HOOKS_DIR=$etc/containers/oci/hooks.d \
  BUILD_DIR=$BIN LIBRARY=$BIN/libgpushare.so MAN_DIR=$MAN_DIR COMPLETIONS_DIR=$COMPLETIONS_DIR \
  STRIP="" MANIFEST=no "$repo/scripts/install-files.sh" >/dev/null
config=$etc/gpushare/config.toml
cp "$config" "$work/config.shipped.toml"
printf '  %-44s %s\n' "${prefix#"$work"/}/bin/" "the programs (below)" \
  "${prefix#"$work"/}/lib/gpushare/libgpushare.so" "the interposer each sharing container loads" \
  "${config#"$work"/}" "the shipped configuration (GPUSHARE_CONFIG names it here)" \
  "${etc#"$work"/}/systemd/system/gpushare-arbiter.service" "the unit that runs the arbiter on a node"
(cd "$prefix/bin" && echo *) | fold -s -w 92 | sed 's/^/    /'
echo "  (under $work; a node has them under /usr/local and /etc)"
export PATH="$prefix/bin:$PATH" GPUSHARE_CONFIG=$config

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
  say "No NVIDIA driver: sharing 2 simulated GPUs of 16 GiB (every figure below is simulated)"
  simulated=1
  mkdir -p "$work/simgpu-lib" "$work/simgpu"
  "$repo/tests/simgpu/install.sh" "$work/simgpu-lib" "$(basename "$BIN")" >/dev/null
  # The arbiter takes its inventory, utilisation and process list through the simulated
  # GPU's NVML: the same code path as on a real node.
  nvml="nvml_library = \"$work/simgpu-lib/libnvidia-ml.so.1\""
  export SIMGPU_DIR="$work/simgpu" SIMGPU_GPUS=2 SIMGPU_MEMORY=16Gi
  for i in 0 1; do
    devices+=$'\n'"[[arbiter.devices]]"$'\n'"uuid = \"GPU-51a6d0e0-0000-4000-8000-00000000000$i\""$'\n'"name = \"simulated GPU $i\""$'\n'"memory = \"16Gi\""$'\n'
  done
fi

# The demo's changes to the installed configuration: its own directories (the installed ones
# are /run/gpushare and /var/lib/gpushare) and, without a driver, the simulated GPUs' NVML.
sed -i -e "s|^run_dir = .*|run_dir = \"$work/run\"|" -e "s|^state_dir = .*|state_dir = \"$work/state\"|" "$config"
if [ -n "$nvml" ]; then sed -i "s|^nvml_library = .*|$nvml|" "$config"; fi
printf '%s' "$devices" >>"$config"
cp "$config" "$out/config.toml"
say "The arbiter's configuration: the installed file with the demo's changes (whole file: $out/config.toml)"
diff -u "$work/config.shipped.toml" "$config" | grep '^[-+][^-+]' | sed 's/^/    /' || true

say "Starting gpushare-arbiter, as the unit would (its log: $out/arbiter.log)"
gpushare-arbiter >"$work/arbiter.log" 2>&1 &
pids+=($!)

cat > "$work/containerd.toml" <<TOML
version = 2
root = "$work/containerd-root"
state = "$work/containerd-state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$work/containerd.sock"
TOML
say "Starting a private containerd ($(containerd --version | awk '{print $3}')), the gpushare shim on its PATH"
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
    for f in "$BIN/simgpu-workload" "$work/simgpu-lib/libcuda.so.1" "$work/simgpu-lib/libnvidia-ml.so.1" "$prefix/lib/gpushare/libgpushare.so"; do
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
# What gpushare gave the container, as the container sees it; the host prints it readably.
show='echo "gpushare-env $GPUSHARE_QUOTA_PRIORITY $NVIDIA_VISIBLE_DEVICES $GPUSHARE_QUOTA_MEMORY $GPUSHARE_LEASE $LD_PRELOAD"'
run() { # name priority memory command > its output
  local mounts=()
  if [ -n "$simulated" ]; then
    mounts=(--mount "type=bind,src=$work/simgpu,dst=/run/simgpu,options=rbind:rw" --env LD_LIBRARY_PATH=/opt/simgpu/lib)
  fi
  ctr -a "$work/containerd.sock" run --rm --rootfs --runtime io.containerd.gpushare.v2 \
    --env PATH=/bin "${mounts[@]}" --annotation gpushare.io/gpu=index:0 \
    --annotation "gpushare.io/priority=$2" --annotation "gpushare.io/memory=$3" \
    "$work/rootfs-$2" "$1" /bin/sh -c "$show; $4" 2>&1
}
# The container's gpushare-env line, readable; its other lines (the workload's JSON report
# aside, kept in $out) as they are.
describe() { # name output-file
  local priority gpu memory lease preload
  while read -r tag priority gpu memory lease preload; do
    [ "$tag" = gpushare-env ] || continue
    printf '  %-16s %-4s priority, GPU %s, memory quota %s, lease %s\n' "$1" "$priority" "$gpu" "$(human_bytes "$memory")" "$lease"
    printf '  %-16s interposer %s\n' "" "$preload"
  done <"$2"
  grep -v -e '^gpushare-env ' -e '^{' "$2" | sed 's/^/  /' || true
}
# A job's report: its JSON line, kept as <name>.json.
report() { grep '^{' "$work/$1.out" >"$out/$1.json" || true; cp "$work/$1.out" "$out/$1.out"; }
# One number from a flat JSON report: json_number file key [object].
json_number() {
  local text
  text=$(cat "$1")
  if [ -n "${3:-}" ]; then text=$(printf '%s' "$text" | grep -o "\"$3\":{[^}]*}" || true); fi
  printf '%s' "$text" | grep -o "\"$2\":[0-9.eE+-]*" | head -n1 | cut -d: -f2 || true
}

if [ -n "$simulated" ]; then
  say "Baselines: each job alone on GPU 0, the figures the shared run is compared with"
  echo "Each container prints what gpushare gave it: its priority, its GPU (NVIDIA_VISIBLE_DEVICES), its memory quota, its lease and the interposer on its LD_PRELOAD. Each workload's report is kept in $out (the figures are below)." | explain
  run demo-high-alone high 4Gi "$high_job" >"$work/high-alone.out"
  describe demo-high-alone "$work/high-alone.out"
  report high-alone
  run demo-low-alone low 25% "$low_job" >"$work/low-alone.out"
  describe demo-low-alone "$work/low-alone.out"
  report low-alone
fi

say "Sharing: a high-priority (4 GiB) and a low-priority (25 % of the GPU's memory) container, both on GPU 0"
if [ -z "$simulated" ]; then high_job="sleep 3"; low_job="sleep 3"; fi
# The timeline below starts here: --since takes whole seconds, so a pause longer than one
# keeps the baselines' holds out of it.
sleep 1.5
shared_start=$(date +%s.%N)
run demo-high high 4Gi "$high_job" >"$work/high.out" &
high=$!
sleep 0.5
run demo-low low 25% "$low_job" >"$work/low.out" &
low=$!
sleep 1.5
say "gpusharectl status while both run (also in $out/status-sharing.txt)"
echo "Each GPU: the memory its processes use (as NVML sees it), the memory leased to containers (their quotas) of what can be allocated, and how busy it was over the last 10 s. Under it, its containers: priority, memory used of the quota, token time (how long the container has held the GPU's time-slice token, its turn on the GPU: its kernels run only then) and its token share of the last 10 s. Then what is waiting and what is wrong. gpusharectl status --verbose adds the scheduler's internals." | explain
gpusharectl status | tee "$out/status-sharing.txt"
wait $high $low
say "What the two containers printed"
describe demo-high "$work/high.out"
describe demo-low "$work/low.out"
report high
report low

# The token service's account of who held each GPU, from the start of the shared run.
since=$(awk -v start="$shared_start" -v now="$(date +%s.%N)" 'BEGIN { s = now - start; print (s == int(s)) ? s : int(s) + 1 }')
say "Who held GPU 0's token when (gpusharectl timeline --since $since; chart in $out/timeline.svg)"
echo "The token service's record of the shared run: each column of the strip is a slice of time, marked with a container that held the token in it (the two take turns far faster than a column, so columns go to each in proportion to its token time); below, each one's token time." | explain
gpusharectl timeline --since "$since" --svg "$out/timeline.svg" | tee "$out/timeline.txt"
gpusharectl timeline --since "$since" --json >"$out/timeline.json"

# Token time the token service counted for a container's lease (ms), from the timeline's JSON.
token_ms() { # container
  # Compacted to one line (names hold no blanks), then one lease object a line.
  tr -d ' \n\t' <"$out/timeline.json" | grep -o '"leases":\[.*' | sed 's/},{/}\n{/g' |
    grep "\"container\":\"$1\"" | grep -o '"token_time_ms":[0-9]*' | head -n1 | cut -d: -f2 || true
}

if [ -n "$simulated" ]; then
  say "What each container got (simulated GPU; the reports are in $out)"
  # The simulated GPU runs on the host's CPUs: on a busy machine every figure is slower and
  # varies from run to run, the high job's too.
  read -r load _ </proc/loadavg
  cpus=$(nproc)
  if awk -v l="$load" -v c="$cpus" 'BEGIN { exit !(l > c) }'; then
    echo "  (load average $load on $cpus CPUs: this machine is busy, so these figures vary between runs)"
  fi
  printf '  %-10s %-9s %12s %13s %9s %17s %11s\n' container priority "alone, it/s" "shared, it/s" "vs alone" "GPU time, shared" "token time"
  for job in high low; do
    alone_rate=$(json_number "$out/$job-alone.json" throughput_iters_per_s)
    shared_rate=$(json_number "$out/$job.json" throughput_iters_per_s)
    kernel_s=$(json_number "$out/$job.json" kernel_time_s)
    elapsed_s=$(json_number "$out/$job.json" elapsed_s)
    held=$(token_ms "demo-$job")
    awk -v name="demo-$job" -v p="$job" -v a="${alone_rate:-0}" -v s="${shared_rate:-0}" \
      -v k="${kernel_s:-0}" -v e="${elapsed_s:-0}" -v h="${held:-}" 'BEGIN {
        vs = a > 0 ? sprintf("%+.1f %%", (s / a - 1) * 100) : "-"
        gpu = e > 0 ? sprintf("%.2f s (%.0f %%)", k, 100 * k / e) : "-"
        tok = h != "" ? sprintf("%.2f s", h / 1000) : "-"
        printf "  %-10s %-9s %12.1f %13.1f %9s %17s %11s\n", name, p, a, s, vs, gpu, tok }'
  done
  echo
  for job in high low; do
    p50=$(json_number "$out/$job-alone.json" p50 period_ms)
    p50_shared=$(json_number "$out/$job.json" p50 period_ms)
    p99_shared=$(json_number "$out/$job.json" p99 period_ms)
    printf '  demo-%-5s one iteration: %.2f ms alone, %.2f ms shared (median); 99th percentile shared %.2f ms\n' "$job" "${p50:-0}" "${p50_shared:-0}" "${p99_shared:-0}"
  done
  echo
  explain <<'NOTE'
alone, shared it/s: iterations per second (one iteration is a burst of kernels and, for the high job, a CPU gap), alone on the GPU and beside the other container; vs alone: the change. GPU time: how long the container's kernels ran on the GPU, as the job measured it, and its part of the job's run. Token time: how long its lease held GPU 0's time-slice token (the token service's account, as in gpusharectl status and the timeline); its kernels run only while it holds the token, so token time is at least its GPU time, the difference being its CPU gaps while holding and the waits for its last kernels to drain.

libgpushare.so holds each container to its memory quota and gates its kernel launches on the GPU's token: the high-priority job takes the token whenever it has work, so its iteration rate stays near its rate alone, and the low-priority job runs in the time it leaves idle. Without the token the GPU would time-slice between them like the hardware does, and the high-priority job's iterations would take about 70 % longer (tests/bench/results).
NOTE
fi

# One watchdog pass (every 2 s) so the status no longer lists the exited processes.
sleep 2.5
say "gpusharectl status after both exited (their leases are released; the 10 s utilisation still counts their last seconds)"
gpusharectl status | tee "$out/status-after.txt"
say "Kept in $out: timeline.svg, timeline.txt, each job's report (*.json), the statuses, config.toml, arbiter.log"
