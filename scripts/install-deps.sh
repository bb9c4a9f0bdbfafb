#!/usr/bin/env bash
# Installs what the tests and the demo need, from the distribution's packages,
# when it is missing: containerd, runc, docker.io (dockerd 20.10 on Debian 12),
# podman, busybox-static (the root filesystem of every test container), faketime, groff.
set -euo pipefail
# --build: only what building needs (make install): the glibc-baseline linker and objdump.
build_only=${1:-}

need_packages=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "$1" ]; }
if [ "$build_only" != --build ]; then
have /usr/bin/containerd || need_packages+=(containerd)
have /usr/bin/ctr || need_packages+=(containerd)
have /usr/sbin/runc || have /usr/bin/runc || need_packages+=(runc)
have /usr/sbin/dockerd || need_packages+=(docker.io)
have /usr/bin/docker || need_packages+=(docker.io)
have /usr/bin/podman || need_packages+=(podman)
# The image's busybox must be static: the test containers hold nothing else.
if ! [ -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; then need_packages+=(busybox-static); fi
have tar || need_packages+=(tar)
# faketime: the arbiter's wall clock jumps in arbiter/tests/clock.rs.
have /usr/bin/faketime || need_packages+=(faketime)
# groff: tools/docgen's test renders every generated man page and fails on warnings.
have groff || need_packages+=(groff-base)
fi
# readelf: the simulated driver's tests check its soname and -Bsymbolic linking; objdump:
# the GLIBC_ versions libgpushare.so needs.
{ have readelf && have objdump; } || need_packages+=(binutils)

if [ ${#need_packages[@]} -gt 0 ]; then
  mapfile -t need_packages < <(printf '%s\n' "${need_packages[@]}" | sort -u)
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages: ${need_packages[*]}; run as root (or: apt-get install ${need_packages[*]})" >&2
    exit 1
  fi
  echo "installing: ${need_packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_packages[@]}" >/dev/null
fi

# libgpushare.so is linked against an old glibc (2.28) so it loads into any usual CUDA
# image: cargo-zigbuild with zig as the linker, both from PyPI (zig ships glibc stubs
# for every version). objdump (binutils, above) checks the result.
if ! command -v cargo-zigbuild >/dev/null 2>&1 || ! { command -v zig >/dev/null 2>&1 || python3 -m ziglang version >/dev/null 2>&1; }; then
  if ! command -v python3 >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then echo "missing python3 (for ziglang and cargo-zigbuild from PyPI)" >&2; exit 1; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3 python3-pip >/dev/null
  fi
  # The versions the baseline build was verified with.
  ZIG_PACKAGES="ziglang==0.17.1 cargo-zigbuild==0.24.0"
  echo "installing: $ZIG_PACKAGES (PyPI)"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q $ZIG_PACKAGES 2>/dev/null \
    || PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --break-system-packages $ZIG_PACKAGES
  hash -r
  command -v cargo-zigbuild >/dev/null 2>&1 || { echo "cargo-zigbuild is not on PATH after pip install" >&2; exit 1; }
fi

if ! command -v cargo >/dev/null 2>&1; then
  cat >&2 <<'MSG'
cargo not found. gpushare builds with the Rust toolchain pinned in rust-toolchain.toml;
install rustup (https://rustup.rs, or `apt-get install rustup` on Debian 13+/Ubuntu 24.04+) and retry.
MSG
  exit 1
fi
