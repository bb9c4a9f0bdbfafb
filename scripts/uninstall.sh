#!/bin/sh
# Removes what scripts/install-files.sh installed (its manifest, PREFIX/share/gpushare/
# installed-files), after stopping the arbiter.
#
# It refuses while a container engine's configuration still names gpushare: docker,
# containerd or podman would then fail every container start that asks for the gpushare
# runtime, with an error about a missing file. `gpusharectl setup --undo <engine>` first
# (FORCE=1 removes anyway).
#
# /etc/gpushare/config.toml is removed only while it is still the file install wrote;
# an edited one is kept, and the script says so.
#
# Environment: PREFIX (/usr/local), SYSCONFDIR (/etc), UNITDIR ($SYSCONFDIR/systemd/system),
# DESTDIR, FORCE.
set -eu

PREFIX=${PREFIX:-/usr/local}
SYSCONFDIR=${SYSCONFDIR:-/etc}
UNITDIR=${UNITDIR:-$SYSCONFDIR/systemd/system}
DESTDIR=${DESTDIR:-}
FORCE=${FORCE:-}
data_dir=$PREFIX/share/gpushare
manifest=$DESTDIR$data_dir/installed-files
unit=gpushare-arbiter.service

if [ ! -f "$manifest" ]; then
    echo "uninstall.sh: $manifest is missing: nothing installed under $DESTDIR$PREFIX by make install" >&2
    exit 1
fi

# Which engine configurations still name gpushare, as `gpusharectl setup` would undo them.
engines=""
grep -qs gpushare "$DESTDIR$SYSCONFDIR/docker/daemon.json" && engines="$engines docker"
grep -qs gpushare "$DESTDIR$SYSCONFDIR/containerd/config.toml" && engines="$engines containerd"
grep -qs gpushare "$DESTDIR$SYSCONFDIR/containers/containers.conf" && engines="$engines podman"
grep -qs gpushare "$DESTDIR$SYSCONFDIR/crio/crio.conf.d/50-gpushare.conf" && engines="$engines crio"
if [ -n "$engines" ]; then
    for engine in $engines; do
        echo "uninstall: $engine's configuration still names gpushare: run 'gpusharectl setup --undo $engine' first, then restart $engine" >&2
    done
    if [ -z "$FORCE" ]; then
        echo "uninstall: nothing removed (FORCE=1 removes anyway)" >&2
        exit 1
    fi
fi

# Stop the arbiter before its binary goes (it would otherwise keep running from a deleted
# file): through systemd where systemd runs this root; otherwise name what still runs.
if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl disable --now "$unit" 2>/dev/null || true
fi
for exe in /proc/[0-9]*/exe; do
    if [ "$(readlink "$exe" 2>/dev/null)" = "$DESTDIR$PREFIX/bin/gpushare-arbiter" ]; then
        pid=${exe#/proc/}
        echo "uninstall: gpushare-arbiter still runs as pid ${pid%/exe}: stop it" >&2
    fi
done

config=$DESTDIR$SYSCONFDIR/gpushare/config.toml
if [ -f "$config" ]; then
    if cmp -s "$config" "$DESTDIR$data_dir/config.toml.default"; then
        rm -f "$config"
        rmdir "$DESTDIR$SYSCONFDIR/gpushare" 2>/dev/null || true
    else
        echo "uninstall: kept $config: it differs from the installed default (remove it yourself if it is no longer wanted)"
    fi
fi

while IFS= read -r path; do
    [ -n "$path" ] || continue
    rm -f "$DESTDIR$path"
done <"$manifest"
# The unit's enablement: `systemctl disable` above removes it where systemd runs; where it
# does not (an image being built, a chroot, DESTDIR) the links `systemctl enable` made stay
# and would dangle.
for link in "$DESTDIR$SYSCONFDIR"/systemd/system/*.wants/"$unit" "$DESTDIR$UNITDIR"/*.wants/"$unit"; do
    if [ -L "$link" ]; then
        rm -f "$link"
        rmdir "$(dirname "$link")" 2>/dev/null || true
    fi
done
# gpushare's own directories, once empty (the shared ones, such as share/man/man1, stay).
for dir in share/doc/gpushare/examples/docker share/doc/gpushare/examples/containerd \
    share/doc/gpushare/examples/hooks.d share/doc/gpushare/examples share/doc/gpushare \
    share/gpushare/grafana share/gpushare lib/gpushare; do
    rmdir "$DESTDIR$PREFIX/$dir" 2>/dev/null || true
done

if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
echo "uninstalled gpushare from $DESTDIR$PREFIX (leases' state in /var/lib/gpushare is kept)"
