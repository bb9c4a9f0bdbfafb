#!/bin/bash
# Builds gpushare's Kubernetes node image with no registry and no base image: a root
# filesystem assembled here (gpushare's programs, the glibc-2.28 libgpushare.so, the shared
# libraries the programs need from this host, found with ldd, and Debian's static busybox
# for the shell steps), built FROM scratch by podman in a private store under target/, and
# saved as an OCI archive that `ctr images import` and `docker load` both accept.
#
#   scripts/build-image.sh [OUTPUT]     (default target/image/gpushare-node.oci.tar)
#   BIN_DIR       the programs                 (default target/release)
#   PRELOAD_LIB   the glibc-2.28 libgpushare.so (default target/x86_64-unknown-linux-gnu/release/libgpushare.so)
#   BUSYBOX       a static busybox             (default /bin/busybox)
#   IMAGE_TAG     (default gpushare/node:<the workspace version in Cargo.toml>)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUTPUT=${1:-target/image/gpushare-node.oci.tar}
BIN_DIR=${BIN_DIR:-target/release}
PRELOAD_LIB=${PRELOAD_LIB:-target/x86_64-unknown-linux-gnu/release/libgpushare.so}
BUSYBOX=${BUSYBOX:-/bin/busybox}
# The workspace's version ([workspace.package] in Cargo.toml), which every crate inherits.
VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
IMAGE_TAG=${IMAGE_TAG:-docker.io/gpushare/node:$VERSION}
PROGRAMS=(gpushare-arbiter gpusharectl gpushare-runc gpushare-hook containerd-shim-gpushare-v2 gpushare-kube)

fail() { echo "build-image: $*" >&2; exit 1; }
[ -n "$VERSION" ] || fail "no version under [workspace.package] in Cargo.toml"
for program in "${PROGRAMS[@]}"; do
  [ -x "$BIN_DIR/$program" ] || fail "BIN_DIR=$BIN_DIR has no $program (make install-build, or name a build with BIN_DIR)"
done
[ -f "$PRELOAD_LIB" ] || fail "PRELOAD_LIB=$PRELOAD_LIB is missing (make preload-baseline-release)"
if [ ! -x "$BUSYBOX" ] || ldd "$BUSYBOX" >/dev/null 2>&1; then
  fail "BUSYBOX=$BUSYBOX is not a static busybox (apt-get install busybox-static)"
fi
command -v podman >/dev/null || fail "podman is missing (apt-get install podman)"

WORK=$ROOT/target/image/work
rm -rf "$WORK"
rootfs=$WORK/context/rootfs
mkdir -p "$rootfs"/{bin,opt/gpushare/bin,opt/gpushare/lib/gpushare,tmp,etc/gpushare,config}
chmod 1777 "$rootfs/tmp"

cp "$BUSYBOX" "$rootfs/bin/busybox"
for applet in $("$BUSYBOX" --list); do
  [ -e "$rootfs/bin/$applet" ] || ln -s busybox "$rootfs/bin/$applet"
done
for program in "${PROGRAMS[@]}"; do
  install -m 0755 "$BIN_DIR/$program" "$rootfs/opt/gpushare/bin/$program"
done
install -m 0644 "$PRELOAD_LIB" "$rootfs/opt/gpushare/lib/gpushare/libgpushare.so"
install -m 0755 deploy/kubernetes/image/node-setup.sh "$rootfs/opt/gpushare/node-setup.sh"

# Every shared library a program loads, at the path the dynamic loader resolved it to
# here, and the loader itself (the absolute path in ldd's output).
for program in "${PROGRAMS[@]}"; do
  ldd "$BIN_DIR/$program" | awk '/=> \//{print $3} /^\t\//{print $1}'
done | sort -u | while read -r lib; do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done
# /lib64 and /lib may be symlinks into /usr here (merged /usr): keep the same shape.
for link in /lib /lib64; do
  if [ -L "$link" ] && [ -d "$rootfs$link" ]; then
    target=$(readlink "$link")
    mkdir -p "$rootfs/$target"
    cp -a "$rootfs$link/." "$rootfs/$target/"
    rm -rf "${rootfs:?}$link"
    ln -s "$target" "$rootfs$link"
  fi
done

revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
cat >"$WORK/context/Containerfile" <<CONTAINERFILE
FROM scratch
COPY rootfs/ /
# The standard directories too: node-setup.sh's nsenter into the host's mount namespace
# runs the host's systemctl, found through this PATH.
ENV PATH=/opt/gpushare/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL org.opencontainers.image.title="gpushare node" \\
      org.opencontainers.image.description="gpushare's arbiter and device plugin, and the runtime side that its init step installs onto the node" \\
      org.opencontainers.image.version="$VERSION" \\
      org.opencontainers.image.revision="$revision" \\
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["/opt/gpushare/bin/gpushare-arbiter", "--config", "/etc/gpushare/config.toml"]
CONTAINERFILE

# A private store: nothing here touches the host's podman images.
podman=(podman --root "$ROOT/target/image/storage" --runroot "$ROOT/target/image/run" --storage-driver vfs)
"${podman[@]}" build --quiet --pull=never --network=none -t "$IMAGE_TAG" "$WORK/context" >/dev/null
mkdir -p "$(dirname "$OUTPUT")"
rm -f "$OUTPUT"
layout=$WORK/layout
"${podman[@]}" save --format oci-dir -o "$layout" "$IMAGE_TAG"
"${podman[@]}" rmi -f "$IMAGE_TAG" >/dev/null
# The OCI layout is what containerd imports (naming the image by the index's
# org.opencontainers.image.ref.name, the full reference); dockerd without containerd's
# image store loads only docker's manifest.json, which is added beside it, naming the same
# blobs: one archive for both, as `docker save` writes since Docker 25.
python3 - "$layout" "${IMAGE_TAG#docker.io/}" <<'PYTHON'
import json, sys, pathlib
layout, tag = pathlib.Path(sys.argv[1]), sys.argv[2]
def blob(digest):
    return "blobs/" + digest.replace(":", "/")
(entry,) = json.loads((layout / "index.json").read_text())["manifests"]
manifest = json.loads((layout / blob(entry["digest"])).read_text())
(layout / "manifest.json").write_text(json.dumps([{
    "Config": blob(manifest["config"]["digest"]),
    "RepoTags": [tag],
    "Layers": [blob(layer["digest"]) for layer in manifest["layers"]],
}]))
PYTHON
tar --sort=name --owner=0 --group=0 --numeric-owner -C "$layout" -cf "$OUTPUT" .
rm -rf "$WORK"
echo "$OUTPUT: $IMAGE_TAG"
