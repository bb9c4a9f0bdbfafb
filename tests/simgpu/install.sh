#!/bin/sh
# Installs the simulated driver libraries under their sonames into DEST, so that programs run
# with LD_LIBRARY_PATH=DEST load them as libcuda.so.1 and libnvidia-ml.so.1.
#   tests/simgpu/install.sh DEST [PROFILE]   (PROFILE: debug (default) or release)
# Build first: cargo build -p simgpu-libcuda -p simgpu-libnvml [--release]
set -eu
dest=${1:?usage: install.sh DEST [PROFILE]}
profile=${2:-debug}
here=$(cd "$(dirname "$0")" && pwd)
target=${CARGO_TARGET_DIR:-$here/../../target}/$profile
mkdir -p "$dest"
for pair in "libcuda.so:libcuda.so.1" "libnvidia_ml.so:libnvidia-ml.so.1"; do
    built=$target/${pair%%:*}
    soname=${pair##*:}
    [ -f "$built" ] || { echo "install.sh: $built is missing: build it first" >&2; exit 1; }
    cp -f "$built" "$dest/$soname"
    # The unversioned development names point at the soname, as a driver install has them.
    ln -sf "$soname" "$dest/${soname%.1}"
done
