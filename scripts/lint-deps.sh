#!/usr/bin/env bash
# The dependency tree against deny.toml: licences, bans and sources always; security
# advisories from RustSec's database wherever it can be fetched (or a copy of it is here).
set -euo pipefail
cd "$(dirname "$0")/.."

# The version deny.toml was written for; built from crates.io once (about 3 minutes on two
# cores), into ~/.cargo/bin.
CARGO_DENY_VERSION=0.20.2
if ! cargo deny --version 2>/dev/null | grep -qx "cargo-deny $CARGO_DENY_VERSION"; then
  echo "installing: cargo-deny $CARGO_DENY_VERSION (crates.io, built from source)"
  cargo install --locked --quiet cargo-deny --version "$CARGO_DENY_VERSION"
fi

cargo deny --log-level error check licenses bans sources

# The database is a git repository on github.com, which some build machines cannot reach:
# then a copy fetched earlier is used (its date is printed either way), and without one the
# check is skipped, saying so.
dbs=${CARGO_HOME:-$HOME/.cargo}/advisory-dbs
cargo deny --log-level error fetch db >/dev/null 2>&1 || true
if copy=$(compgen -G "$dbs/advisory-db-*/.git"); then
  copy=$(dirname "$(head -1 <<<"$copy")")
  echo "advisories: RustSec database as of $(git -C "$copy" log -1 --format=%cs)"
  cargo deny --log-level error --offline check advisories
else
  echo "advisories: NOT CHECKED: RustSec's database (github.com/RustSec/advisory-db) cannot be fetched from this machine"
fi
