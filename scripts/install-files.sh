#!/bin/sh
# Copies already-built gpushare files into place; `make install` builds them first, and the
# Debian package (`make deb`) stages its tree with this same script (PREFIX=/usr).
#
# Every path written is $DESTDIR + its installed path, and every installed path that names
# another (the configuration's runtime.library and runtime.hook, the unit's ExecStart and
# Documentation) is written for PREFIX, so nothing needs editing by hand for another prefix.
#
# Environment (the Makefile sets these):
#   PREFIX (/usr/local)   programs, library, man pages, completions, documentation
#   SYSCONFDIR (/etc)     gpushare/config.toml, installed only when absent (an upgrade keeps yours)
#   UNITDIR               the systemd unit (default $SYSCONFDIR/systemd/system)
#   ZSH_COMPLETIONS_DIR   default $PREFIX/share/zsh/site-functions
#   HOOKS_DIR             podman's OCI hooks (default $SYSCONFDIR/containers/oci/hooks.d, where
#                         podman looks for the administrator's; the package: /usr/share/...)
#   DESTDIR               staging root prepended to every path written
#   BUILD_DIR             where the binaries are (target/release)
#   LIBRARY               the libgpushare.so to ship (the glibc-2.28 baseline build)
#   MAN_DIR, COMPLETIONS_DIR  what `make man` wrote (target/man, target/completions)
#   STRIP (strip)         "" to keep symbols
#   MANIFEST (yes)        "no": write no uninstall manifest (the package's files are dpkg's)
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${PREFIX:-/usr/local}
SYSCONFDIR=${SYSCONFDIR:-/etc}
UNITDIR=${UNITDIR:-$SYSCONFDIR/systemd/system}
ZSH_COMPLETIONS_DIR=${ZSH_COMPLETIONS_DIR:-$PREFIX/share/zsh/site-functions}
HOOKS_DIR=${HOOKS_DIR:-$SYSCONFDIR/containers/oci/hooks.d}
DESTDIR=${DESTDIR:-}
BUILD_DIR=${BUILD_DIR:-$here/target/release}
LIBRARY=${LIBRARY:-$here/target/x86_64-unknown-linux-gnu/release/libgpushare.so}
MAN_DIR=${MAN_DIR:-$here/target/man}
COMPLETIONS_DIR=${COMPLETIONS_DIR:-$here/target/completions}
STRIP=${STRIP-strip}
MANIFEST=${MANIFEST:-yes}
BINARIES="gpushare-arbiter gpusharectl gpushare-runc gpushare-hook containerd-shim-gpushare-v2 gpushare-kube"

data_dir=$PREFIX/share/gpushare
installed=""

# put SOURCE MODE INSTALLED-PATH: installs and records INSTALLED-PATH for uninstall.
put() {
    install -D -m "$2" "$1" "$DESTDIR$3"
    installed="$installed$3
"
}

# The paths the shipped files name are written for /usr/local; these rewrite them for PREFIX.
# Only the host-side ones: runtime.container_library is a path inside containers.
for_prefix_config() {
    sed -e "s|^library = \"/usr/local/|library = \"$PREFIX/|" \
        -e "s|^hook = \"/usr/local/|hook = \"$PREFIX/|" "$1"
}
for_prefix_unit() {
    sed -e "s|/usr/local/|$PREFIX/|g" "$1"
}

for f in $BINARIES; do
    [ -f "$BUILD_DIR/$f" ] || { echo "install-files.sh: $BUILD_DIR/$f is missing: build it first" >&2; exit 1; }
done
[ -f "$LIBRARY" ] || { echo "install-files.sh: $LIBRARY is missing: make preload-baseline-release" >&2; exit 1; }
[ -d "$MAN_DIR" ] && [ -d "$COMPLETIONS_DIR" ] || { echo "install-files.sh: $MAN_DIR or $COMPLETIONS_DIR is missing: make man" >&2; exit 1; }

for f in $BINARIES; do
    put "$BUILD_DIR/$f" 0755 "$PREFIX/bin/$f"
    # Stripped: 166 MB of debug info for 11 MB of code otherwise.
    [ -z "$STRIP" ] || "$STRIP" "$DESTDIR$PREFIX/bin/$f"
done
put "$LIBRARY" 0644 "$PREFIX/lib/gpushare/libgpushare.so"
# Loaded into every CUDA process of every sharing container: 8.9 MB unstripped, 0.8 MB stripped.
[ -z "$STRIP" ] || "$STRIP" --strip-unneeded "$DESTDIR$PREFIX/lib/gpushare/libgpushare.so"

# Section 1, the programs; section 5, gpushare.toml, the configuration file.
for page in "$MAN_DIR"/*.1 "$MAN_DIR"/*.5; do
    put "$page" 0644 "$PREFIX/share/man/man${page##*.}/$(basename "$page")"
done
for c in "$COMPLETIONS_DIR"/*; do
    name=$(basename "$c")
    case $name in
        *.bash) put "$c" 0644 "$PREFIX/share/bash-completion/completions/${name%.bash}" ;;
        *.fish) put "$c" 0644 "$PREFIX/share/fish/vendor_completions.d/$name" ;;
        _*) put "$c" 0644 "$ZSH_COMPLETIONS_DIR/$name" ;;
    esac
done
put "$here/README.md" 0644 "$PREFIX/share/doc/gpushare/README.md"
for doc in "$here"/docs/*.md; do put "$doc" 0644 "$PREFIX/share/doc/gpushare/${doc##*/}"; done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for_prefix_unit "$here/config/systemd/gpushare-arbiter.service" >"$tmp/gpushare-arbiter.service"
put "$tmp/gpushare-arbiter.service" 0644 "$UNITDIR/gpushare-arbiter.service"

# The engines' configuration, for this PREFIX, for reading (gpusharectl setup writes them).
for example in docker/daemon-20.10.json docker/daemon-24.json containerd/config-v2.toml \
    containerd/config-v3.toml hooks.d/gpushare.json; do
    for_prefix_unit "$here/config/$example" >"$tmp/example"
    put "$tmp/example" 0644 "$PREFIX/share/doc/gpushare/examples/$example"
done

# podman runs the precreate hook for containers that ask for gpushare (the hook's `when`
# matches gpushare.io/ annotations only), without its runtime being changed.
for_prefix_unit "$here/config/hooks.d/gpushare.json" >"$tmp/hook.json"
put "$tmp/hook.json" 0644 "$HOOKS_DIR/gpushare.json"
# The Grafana dashboard (deploy/grafana): point a dashboard provider at this directory.
put "$here/deploy/grafana/gpushare.json" 0644 "$data_dir/grafana/gpushare.json"

for_prefix_config "$here/config/config.toml" >"$tmp/config.toml"
config=$SYSCONFDIR/gpushare/config.toml
if [ -e "$DESTDIR$config" ]; then
    echo "kept $DESTDIR$config (this install's default is $DESTDIR$data_dir/config.toml.default)"
    if ! grep -q "^library = \"$PREFIX/lib/gpushare/libgpushare.so\"" "$DESTDIR$config"; then
        echo "note: $DESTDIR$config: runtime.library is not $PREFIX/lib/gpushare/libgpushare.so: check runtime.library and runtime.hook" >&2
    fi
else
    install -D -m 0644 "$tmp/config.toml" "$DESTDIR$config"
fi
# The default as installed: uninstall removes config.toml only while it is still equal.
put "$tmp/config.toml" 0644 "$data_dir/config.toml.default"

if [ "$MANIFEST" = yes ]; then
    # What uninstall removes, one installed path a line (the manifest itself last).
    printf '%s%s\n' "$installed" "$data_dir/installed-files" >"$tmp/manifest"
    install -D -m 0644 "$tmp/manifest" "$DESTDIR$data_dir/installed-files"
fi
echo "installed gpushare under $DESTDIR$PREFIX (configuration $DESTDIR$config, unit $DESTDIR$UNITDIR/gpushare-arbiter.service)"
