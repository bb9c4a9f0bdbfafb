#!/bin/sh
# Installs the pinned cargo-deb into the project's own tool directory (target/tools by
# default), never into the system or ~/.cargo: `make deb` and tests/deploy's package test
# run it from there. Prints the path of the binary.
set -eu

CARGO_DEB_VERSION=3.8.0
root=${GPUSHARE_TOOLS_DIR:-$(cd "$(dirname "$0")/.." && pwd)/target/tools}
bin=$root/bin/cargo-deb

if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q " $CARGO_DEB_VERSION\$"; then
    echo "$bin"
    exit 0
fi
echo "installing cargo-deb $CARGO_DEB_VERSION into $root" >&2
# --locked: the versions its own Cargo.lock was released with.
cargo install --locked --quiet "cargo-deb@$CARGO_DEB_VERSION" --root "$root" >&2
echo "$bin"
