#!/bin/sh
# Installs gpushare's runtime side onto a Kubernetes node, or takes it off again.
#
#   node-setup.sh install   copy the programs and libgpushare.so under /opt/gpushare and
#                           /etc/gpushare/config.toml onto the host, add gpushare's runtime
#                           to the host's containerd config.toml (gpusharectl setup
#                           containerd, which keeps every other line), and restart
#                           containerd when, and only when, that file changed.
#   node-setup.sh undo      the reverse: containerd's file as it was byte for byte, the
#                           installed files gone, a previous /etc/gpushare/config.toml back.
#
# Run inside the node image (the DaemonSet's init container and preStop hook, or a test).
# Everything host-side is a parameter, so the same steps can run against a scratch tree:
#   HOST_ROOT            where the host's root is mounted            (default /host)
#   CONTAINERD_CONFIG    containerd's file, as the host names it     (default /etc/containerd/config.toml)
#   GPUSHARE_CONFIG_SOURCE  the config.toml to install               (default /config/config.toml)
#   RESTART_CONTAINERD   the command restarting the host's containerd
#                        (default: nsenter -t 1 -m -- systemctl restart containerd; needs hostPID)
#
# The prefix is /opt/gpushare on the host because it is /opt/gpushare in this image:
# `gpusharectl setup --bin-dir /opt/gpushare/bin` checks gpushare-runc exists where it
# runs (here, the image's identical copy) and writes that path, which is the host's.
set -eu

PREFIX=/opt/gpushare
HOST_ROOT=${HOST_ROOT:-/host}
CONTAINERD_CONFIG=${CONTAINERD_CONFIG:-/etc/containerd/config.toml}
GPUSHARE_CONFIG_SOURCE=${GPUSHARE_CONFIG_SOURCE:-/config/config.toml}
RESTART_CONTAINERD=${RESTART_CONTAINERD:-nsenter -t 1 -m -- systemctl restart containerd}

PROGRAMS="gpushare-runc gpushare-hook containerd-shim-gpushare-v2 gpusharectl"
LIBRARY=lib/gpushare/libgpushare.so
CONFIG=/etc/gpushare/config.toml
# An operator's own /etc/gpushare/config.toml (e.g. from the Debian package) is kept
# here while the DaemonSet's is installed.
CONFIG_BACKUP=$CONFIG.gpushare-node-backup
# Directories install created, so undo removes those and only those.
CREATED=$PREFIX/node-setup.created

host=$HOST_ROOT
containerd_file=$host$CONTAINERD_CONFIG

say() { echo "node-setup: $*"; }

# Copies beside the target and renames over it: a running shim or hook keeps its old
# inode, and nothing ever executes a half-written file.
put() {
    cp "$1" "$2.new"
    chmod "$3" "$2.new"
    mv -f "$2.new" "$2"
}

# mkdir -p that remembers each directory it made, parents first.
created=""
make_dir() {
    [ -d "$host$1" ] && return 0
    make_dir "$(dirname "$1")"
    mkdir "$host$1"
    created="$created $1"
}

restart_containerd_if_changed() {
    if cmp -s "$1" "$containerd_file" 2>/dev/null; then
        say "$CONTAINERD_CONFIG unchanged; containerd not restarted"
    else
        # Running containers survive: their shims hold them, and containerd
        # reconnects to the shims when it comes back.
        say "$CONTAINERD_CONFIG changed; restarting containerd: $RESTART_CONTAINERD"
        sh -c "$RESTART_CONTAINERD"
    fi
}

snapshot() {
    rm -f "$1"
    if [ -e "$containerd_file" ]; then cp -p "$containerd_file" "$1"; fi
}

install() {
    [ -d "$host" ] || { say "HOST_ROOT=$host is not a directory"; exit 1; }
    [ -r "$GPUSHARE_CONFIG_SOURCE" ] || { say "GPUSHARE_CONFIG_SOURCE=$GPUSHARE_CONFIG_SOURCE cannot be read"; exit 1; }
    for dir in "$PREFIX/bin" "$PREFIX/lib/gpushare" "$(dirname "$CONFIG")" "$(dirname "$CONTAINERD_CONFIG")"; do
        make_dir "$dir"
    done
    for program in $PROGRAMS; do
        put "$PREFIX/bin/$program" "$host$PREFIX/bin/$program" 0755
    done
    put "$PREFIX/$LIBRARY" "$host$PREFIX/$LIBRARY" 0644
    # A reinstall (the pod restarted) keeps the first install's records.
    if [ ! -e "$host$CREATED" ]; then
        if [ -e "$host$CONFIG" ]; then cp -p "$host$CONFIG" "$host$CONFIG_BACKUP"; fi
        echo "$created" | tr ' ' '\n' | sed '/^$/d' >"$host$CREATED"
    fi
    put "$GPUSHARE_CONFIG_SOURCE" "$host$CONFIG" 0644

    before=$(mktemp)
    snapshot "$before"
    "$PREFIX/bin/gpusharectl" setup containerd --config "$containerd_file" --bin-dir "$PREFIX/bin"
    restart_containerd_if_changed "$before"
    rm -f "$before"
    say "installed under $PREFIX"
}

undo() {
    before=$(mktemp)
    snapshot "$before"
    if [ -e "$containerd_file" ]; then
        "$PREFIX/bin/gpusharectl" setup containerd --undo --config "$containerd_file" --bin-dir "$PREFIX/bin"
    fi
    restart_containerd_if_changed "$before"
    rm -f "$before"

    if [ -e "$host$CONFIG_BACKUP" ]; then
        mv -f "$host$CONFIG_BACKUP" "$host$CONFIG"
    else
        rm -f "$host$CONFIG"
    fi
    for program in $PROGRAMS; do rm -f "$host$PREFIX/bin/$program"; done
    rm -f "$host$PREFIX/$LIBRARY"
    dirs=""
    if [ -e "$host$CREATED" ]; then
        # Deepest first: each directory is listed after its parent.
        dirs=$(sed -n '1!G;h;$p' "$host$CREATED")
        rm -f "$host$CREATED"
    fi
    for dir in $dirs; do
        rmdir "$host$dir" 2>/dev/null || say "left $dir: not empty"
    done
    say "removed"
}

case "${1:-}" in
install) install ;;
undo) undo ;;
*)
    echo "usage: node-setup.sh install|undo (accepted: install, undo; got '${1:-}')" >&2
    exit 2
    ;;
esac
