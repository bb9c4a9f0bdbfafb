#!/usr/bin/env bash
# Installs what one command of the Makefile needs, and only what is missing:
#
#   install-deps.sh demo     make demo: containerd and ctr, runc, busybox-static, binutils, zig
#   install-deps.sh test     make test (the default): the demo's, plus dockerd and docker, podman,
#                            tar, faketime, groff, systemd-analyze, kill (procps), promtool
#                            (prometheus), man (man-db)
#   install-deps.sh build    make install (also --build): binutils and the zig toolchain
#   ... --plan               print what is present and what would be installed, and install nothing
#
# A container engine already on the machine is never replaced. What a program provides is
# found by looking for it (PATH, /usr/local/{s,}bin, /usr/{s,}bin, /{s,}bin, running processes)
# and by asking dpkg; Docker CE's packages (docker-ce, containerd.io, which ships containerd,
# ctr and runc) conflict with Debian's docker.io, containerd and runc, so where any of Docker's
# or Microsoft's engine packages is installed none of Debian's is planned: a missing piece is
# reported with the package that provides it instead. apt-get runs with --no-remove, so a plan
# that would take any package off the machine aborts before changing anything.
#
# The zig toolchain (ziglang and cargo-zigbuild, from PyPI) goes into a virtual environment of
# the project's own, $GPUSHARE_TOOLS_DIR/venv (target/tools/venv by default), never into a
# system Python; the Makefile puts its bin/ first on PATH for the libgpushare.so build.
#
# For tests, GPUSHARE_DEPS_ROOT names a private root to probe in place of the machine's (its
# standard directories and proc/; PATH is then not searched for engines), and dpkg-query is
# whichever PATH finds first.
set -euo pipefail

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
}

mode=test
plan_only=
for arg in "$@"; do
  case $arg in
    demo | test | build) mode=$arg ;;
    --build) mode=build ;;
    --plan) plan_only=1 ;;
    -h | --help) usage; exit 0 ;;
    *)
      echo "install-deps.sh: unknown argument '$arg'; accepted: demo, test, build (or --build), --plan, --help" >&2
      exit 2
      ;;
  esac
done

ROOT=${GPUSHARE_DEPS_ROOT:-}
ROOT=${ROOT%/}
repo=$(cd "$(dirname "$0")/.." && pwd)
tools_dir=${GPUSHARE_TOOLS_DIR:-$repo/target/tools}
venv=$tools_dir/venv
# The versions the glibc-baseline build was verified with.
ZIG_PACKAGES=(ziglang==0.17.1 cargo-zigbuild==0.24.0)

# ----------------------------------------------------------------------------------------
# Probes: what the machine (or the private root) has.
# ----------------------------------------------------------------------------------------

probe_dirs=()
if [ -z "$ROOT" ]; then IFS=: read -ra probe_dirs <<<"$PATH"; fi
probe_dirs+=("$ROOT/usr/local/sbin" "$ROOT/usr/local/bin" "$ROOT/usr/sbin" "$ROOT/usr/bin" "$ROOT/sbin" "$ROOT/bin")

# The first executable called $1 in the probe directories (or $2…, more directories first).
find_program() {
  local name=$1 d
  shift
  for d in "$@" "${probe_dirs[@]}"; do
    if [ -n "$d" ] && [ -f "$d/$name" ] && [ -x "$d/$name" ]; then
      printf '%s\n' "$d/$name"
      return 0
    fi
  done
  return 1
}

# The pid of a running process whose command name is $1 (a daemon may run from anywhere).
running() {
  local comm name
  for comm in "$ROOT"/proc/[0-9]*/comm; do
    [ -r "$comm" ] || continue
    read -r name <"$comm" 2>/dev/null || continue
    if [ "$name" = "$1" ]; then
      comm=${comm%/comm}
      printf '%s\n' "${comm##*/}"
      return 0
    fi
  done
  return 1
}

have_dpkg=
command -v dpkg-query >/dev/null 2>&1 && have_dpkg=1
# Debian's engine packages, and Docker's and Microsoft's, which conflict with them.
DEBIAN_ENGINE_PACKAGES=(docker.io containerd runc podman crun)
VENDOR_ENGINE_PACKAGES=(docker-ce docker-ce-cli docker-ce-rootless-extras docker-ee docker-ee-cli
  containerd.io moby-engine moby-cli moby-containerd moby-runc)
declare -A installed=()
if [ -n "$have_dpkg" ]; then
  while IFS=$'\t' read -r package status; do
    case $status in *" installed") installed[$package]=1 ;; esac
  done < <(dpkg-query -W -f='${Package}\t${Status}\n' "${DEBIAN_ENGINE_PACKAGES[@]}" "${VENDOR_ENGINE_PACKAGES[@]}" \
    busybox-static binutils faketime groff-base tar python3 python3-venv 2>/dev/null || true)
fi
vendor_engine=()
for p in "${VENDOR_ENGINE_PACKAGES[@]}"; do [ -n "${installed[$p]:-}" ] && vendor_engine+=("$p"); done

# " (package)" for the package that owns $1, as dpkg knows it.
owner() {
  [ -n "$have_dpkg" ] || return 0
  local path=${1#"$ROOT"} found
  found=$(dpkg-query -S "$path" 2>/dev/null | head -n1) || return 0
  [ -n "$found" ] && printf ' (%s)' "${found%%:*}"
  return 0
}

# ----------------------------------------------------------------------------------------
# The plan: one line a need, then the packages.
# ----------------------------------------------------------------------------------------

apt_packages=()
venv_packages=()
missing=0
lines=()
add_apt() { local p; for p in "$@"; do [[ " ${apt_packages[*]} " == *" $p "* ]] || apt_packages+=("$p"); done; }
have_line() { lines+=("$(printf '  have     %-16s %s' "$1" "$2")"); }
install_line() { lines+=("$(printf '  install  %-16s %s' "$1" "$2")"); }
missing_line() { lines+=("$(printf '  MISSING  %-16s %s' "$1" "$2")"); missing=1; }

# An engine program: present on disk or running, or installed from a Debian package when no
# vendor engine is there to conflict with it. $1 program, $2 Debian package, $3 why needed,
# $4 the vendor package that provides it.
need_engine_program() {
  local program=$1 package=$2 why=$3 vendor_package=$4 path pid
  if path=$(find_program "$program"); then
    have_line "$program" "$path$(owner "$path")"
  elif pid=$(running "$program"); then
    have_line "$program" "running (pid $pid), not on PATH"
  elif [ ${#vendor_engine[@]} -gt 0 ]; then
    missing_line "$program" "$why; not installing Debian's $package beside ${vendor_engine[*]} (they conflict): install $vendor_package from the same repository as ${vendor_engine[0]}"
  else
    add_apt "$package"
    install_line "$program" "apt $package: $why"
  fi
}

# A tool: $1 program, $2 package, $3 why.
need_tool() {
  local path
  if path=$(find_program "$1"); then
    have_line "$1" "$path"
  else
    add_apt "$2"
    install_line "$1" "apt $2: $3"
  fi
}

need_static_busybox() {
  local busybox=$ROOT/bin/busybox
  if [ -x "$busybox" ] && ! ldd "$busybox" >/dev/null 2>&1; then
    have_line busybox "$busybox, static"
  else
    add_apt busybox-static
    install_line busybox "apt busybox-static: the whole root filesystem of every test and demo container ($busybox is missing or dynamically linked)"
  fi
}

# libgpushare.so links against glibc 2.28 with cargo-zigbuild and zig, whatever the host's glibc.
need_zig_toolchain() {
  local cargo_zigbuild python zig
  if cargo_zigbuild=$(find_program cargo-zigbuild "$venv/bin"); then
    if zig=$(find_program zig "$venv/bin"); then
      have_line zig-toolchain "$cargo_zigbuild, $zig"
      return
    fi
    if python=$(find_program python3 "$venv/bin") && "$python" -m ziglang version >/dev/null 2>&1; then
      have_line zig-toolchain "$cargo_zigbuild, ziglang in $python"
      return
    fi
  fi
  venv_packages=("${ZIG_PACKAGES[@]}")
  install_line zig-toolchain "venv $venv: ${ZIG_PACKAGES[*]} from PyPI (links libgpushare.so against glibc 2.28)"
  # Debian's python3 makes virtual environments only with python3-venv (ensurepip).
  if ! python=$(find_program python3); then
    add_apt python3 python3-venv
    install_line python3 "apt python3 python3-venv: to make the virtual environment"
  elif ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    add_apt python3-venv
    install_line python3-venv "apt python3-venv: $python cannot make a virtual environment without it"
  fi
}

case $mode in
  demo | test)
    need_engine_program containerd containerd "runs the containers" containerd.io
    need_engine_program ctr containerd "containerd's client, which starts them" containerd.io
    need_engine_program runc runc "creates every container" containerd.io
    need_static_busybox
    ;;
esac
if [ "$mode" = test ]; then
  need_engine_program dockerd docker.io "the docker e2e tests run a private dockerd" docker-ce
  need_engine_program docker docker.io "the docker e2e tests' client" docker-ce-cli
  # Debian's podman depends on crun or runc, which containerd.io provides: no conflict (and
  # apt-get's --no-remove below stops any plan that would take an engine off).
  need_tool podman podman "the podman e2e tests"
  need_tool tar tar "the test images"
  need_tool faketime faketime "arbiter/tests/clock.rs jumps the arbiter's wall clock"
  need_tool groff groff-base "tools/docgen's test renders every man page and fails on warnings"
  need_tool systemd-analyze systemd "tests/deploy's systemd_unit verifies the unit and scores its hardening"
  need_tool kill procps "the unit's ExecReload (/bin/kill), which systemd-analyze verify looks for"
  need_tool readelf binutils "the simulated driver's tests check its soname and -Bsymbolic linking"
  need_tool lintian lintian "tests/e2e's debian_package holds the package to no lintian error or warning"
  need_tool promtool prometheus "the arbiter's metrics test checks a live scrape with promtool check metrics"
  need_tool man man-db "tools/docgen's test renders every man page with man -l"
fi
need_tool objdump binutils "make checks the GLIBC_ versions libgpushare.so needs"
need_zig_toolchain

# Said before anything is installed; silent when there is nothing to do.
if [ -n "$plan_only" ] || [ ${#apt_packages[@]} -gt 0 ] || [ ${#venv_packages[@]} -gt 0 ] || [ "$missing" = 1 ]; then
  echo "gpushare: what '$mode' needs${ROOT:+ (probing $ROOT)}:"
  printf '%s\n' "${lines[@]}"
  echo "apt-get install: ${apt_packages[*]}"
  echo "python venv $venv: ${venv_packages[*]}"
fi
if [ -n "$plan_only" ]; then exit 0; fi
if [ "$missing" = 1 ]; then
  echo "warning: the MISSING programs above are left for you to install; what needs them will fail or skip" >&2
fi

if [ ${#apt_packages[@]} -gt 0 ]; then
  if [ "$EUID" -ne 0 ]; then
    echo "installing packages needs root: run this as root, or: apt-get install --no-remove ${apt_packages[*]}" >&2
    exit 1
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "no apt-get here: install the programs above with your distribution's package manager" >&2
    exit 1
  fi
  echo "installing with apt-get: ${apt_packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # --no-remove: abort rather than take any installed package (an engine) off the machine.
  apt-get install -y -qq --no-install-recommends --no-remove "${apt_packages[@]}" >/dev/null
fi

if [ ${#venv_packages[@]} -gt 0 ]; then
  echo "installing into $venv: ${venv_packages[*]}"
  python=$(find_program python3)
  [ -x "$venv/bin/python3" ] || "$python" -m venv "$venv"
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check "${venv_packages[@]}"
  [ -x "$venv/bin/cargo-zigbuild" ] || { echo "no $venv/bin/cargo-zigbuild after installing ${venv_packages[*]}" >&2; exit 1; }
fi

if ! command -v cargo >/dev/null 2>&1; then
  cat >&2 <<'MSG'
cargo not found. gpushare builds with the Rust toolchain pinned in rust-toolchain.toml;
install rustup (https://rustup.rs, or `apt-get install rustup` on Debian 13+/Ubuntu 24.04+) and retry.
MSG
  exit 1
fi
