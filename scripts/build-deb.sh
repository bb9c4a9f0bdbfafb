#!/bin/sh
# Builds the Debian package from already-built files (`make deb` builds them first):
# scripts/install-files.sh stages the tree with PREFIX=/usr, then the pinned cargo-deb
# (scripts/install-cargo-deb.sh) packages it as packaging/deb/Cargo.toml describes.
#
# Environment:
#   BUILD_DIR, LIBRARY, MAN_DIR, COMPLETIONS_DIR   what to package (install-files.sh's
#                      defaults: target/release and the release baseline libgpushare.so);
#                      tests package the debug build, stripped the same way
#   DEB_VERSION        the package version (default: the workspace's version)
#   OUT                where the .deb goes (default target/debian); its path is printed last
#   WORK               scratch directory (default target/deb-build)
#   FAST=1             faster, larger compression (tests)
#   DEB_MAINTAINER     the Maintainer field, "Name <address>" (default: packaging/deb's)
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$here/target/debian}
WORK=${WORK:-$here/target/deb-build}
DEB_VERSION=${DEB_VERSION:-$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$here/Cargo.toml")}
cargo_deb=$("$here/scripts/install-cargo-deb.sh")

rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"
cp -r "$here/packaging/deb/." "$WORK/"
DESTDIR=$WORK/root PREFIX=/usr SYSCONFDIR=/etc UNITDIR=/usr/lib/systemd/system \
    ZSH_COMPLETIONS_DIR=/usr/share/zsh/vendor-completions HOOKS_DIR=/usr/share/containers/oci/hooks.d \
    MANIFEST=no \
    "$here/scripts/install-files.sh" >/dev/null

# The oldest libc6 the package's programs run on: the highest GLIBC_ symbol version any of
# them needs (libgpushare.so's own baseline, 2.28, is lower).
glibc=$(for f in "$WORK"/root/usr/bin/* "$WORK"/root/usr/lib/gpushare/libgpushare.so; do
    objdump -T "$f"
done | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n1)
sed -i "s/@GLIBC@/$glibc/" "$WORK/Cargo.toml"
if [ -n "${DEB_MAINTAINER:-}" ]; then
    sed -i "s|^maintainer = .*|maintainer = \"$DEB_MAINTAINER\"|" "$WORK/Cargo.toml"
fi
maintainer=$(sed -n 's/^maintainer = "\(.*\)"$/\1/p' "$WORK/Cargo.toml")

# The changelog Debian Policy asks of every package (12.7; a native one's is changelog.gz):
# one entry for this build, dated by the commit it was built from (reproducible), or now
# outside a git checkout.
when=$(git -C "$here" log -1 --format=%ct 2>/dev/null || date +%s)
{
    printf 'gpushare (%s) unstable; urgency=medium\n\n' "$DEB_VERSION"
    printf '  * Built from the gpushare repository; what changed is in its history.\n\n'
    printf ' -- %s  %s\n' "$maintainer" "$(LC_ALL=C date -u -R -d "@$when")"
} | gzip -9n > "$WORK/changelog.gz"

# --no-build: everything is staged; --no-strip: install-files.sh stripped it already.
"$cargo_deb" --manifest-path "$WORK/Cargo.toml" --no-build --no-strip --quiet ${FAST:+--fast} \
    --deb-version "$DEB_VERSION" --output "$OUT/gpushare_${DEB_VERSION}_$(dpkg --print-architecture).deb"
echo "$OUT/gpushare_${DEB_VERSION}_$(dpkg --print-architecture).deb"
