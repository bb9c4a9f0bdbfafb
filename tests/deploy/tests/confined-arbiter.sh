#!/bin/sh
# Starts $GPUSHARE_CONFINED_PROGRAM (the arbiter) as its systemd unit would, as far as
# that can be done without systemd: only the unit's capabilities
# ($GPUSHARE_CONFINED_BOUNDING_SET, setpriv's syntax), none inheritable, no_new_privs.
# tests/systemd_unit.rs starts it as a private arbiter's program.
exec setpriv --bounding-set="$GPUSHARE_CONFINED_BOUNDING_SET" --inh-caps=-all --no-new-privs \
    "$GPUSHARE_CONFINED_PROGRAM" "$@"
