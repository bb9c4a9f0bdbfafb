# gpushare — the README's commands. `make demo` and `make test` work on a fresh
# Debian/Ubuntu machine as root: they install what they need from the distribution.

PREFIX ?= /usr/local
CARGO ?= cargo
BIN_DIR := $(CURDIR)/target/debug
RELEASE_DIR := $(CURDIR)/target/release
BINARIES := gpushare-arbiter gpusharectl gpushare-runc gpushare-hook containerd-shim-gpushare-v2

.PHONY: all build deps lint test bench demo install uninstall clean

all: build

deps:
	@scripts/install-deps.sh

build:
	$(CARGO) build --workspace

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Unit tests, then the e2e tests against real runc/containerd/dockerd in private
# daemons (they need root and the packages `deps` installs).
test: deps lint build
	GPUSHARE_BIN_DIR=$(BIN_DIR) $(CARGO) test --workspace

# Benchmarks measure release builds, what `make install` ships (root; real dockerd).
bench: deps
	$(CARGO) build --workspace --release
	GPUSHARE_BIN_DIR=$(RELEASE_DIR) $(CARGO) bench --workspace

demo: deps build
	@GPUSHARE_BIN_DIR=$(BIN_DIR) scripts/demo.sh

install:
	$(CARGO) build --workspace --release
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/gpushare $(DESTDIR)/etc/gpushare
	for b in $(BINARIES); do install -m 0755 $(RELEASE_DIR)/$$b $(DESTDIR)$(PREFIX)/bin/$$b; done
	install -m 0644 $(RELEASE_DIR)/libgpushare.so $(DESTDIR)$(PREFIX)/lib/gpushare/libgpushare.so
	[ -e $(DESTDIR)/etc/gpushare/config.toml ] || install -m 0644 config/config.toml $(DESTDIR)/etc/gpushare/config.toml
	install -D -m 0644 config/systemd/gpushare-arbiter.service $(DESTDIR)/etc/systemd/system/gpushare-arbiter.service
	@if [ "$(PREFIX)" != /usr/local ]; then echo "note: set runtime.library and runtime.hook in /etc/gpushare/config.toml to $(PREFIX)/lib/gpushare/libgpushare.so and $(PREFIX)/bin/gpushare-hook"; fi

uninstall:
	for b in $(BINARIES); do rm -f $(DESTDIR)$(PREFIX)/bin/$$b; done
	rm -rf $(DESTDIR)$(PREFIX)/lib/gpushare
	rm -f $(DESTDIR)/etc/systemd/system/gpushare-arbiter.service

clean:
	$(CARGO) clean
