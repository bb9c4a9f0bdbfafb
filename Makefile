# gpushare — the README's commands. `make demo` and `make test` work on a fresh
# Debian/Ubuntu machine as root: they install what they need from the distribution.

PREFIX ?= /usr/local
CARGO ?= cargo
BIN_DIR := $(CURDIR)/target/debug
RELEASE_DIR := $(CURDIR)/target/release
# libgpushare.so is loaded into containers' processes, whose glibc may be as old as
# 2.28 (Rocky 8, Ubuntu 20.04+): it is linked against that baseline with
# cargo-zigbuild, and the build fails if it needs any newer GLIBC_ symbol version.
GLIBC_BASELINE := 2.28
BASELINE_TARGET := x86_64-unknown-linux-gnu.$(GLIBC_BASELINE)
BASELINE_DIR := $(CURDIR)/target/x86_64-unknown-linux-gnu

.PHONY: all build deps lint test test-containerd-2 bench demo gpu-check install install-build uninstall deb image clean preload-baseline preload-baseline-release check-glibc

all: build

# What the goal at hand needs, and only that (scripts/install-deps.sh says what it would
# install first; `scripts/install-deps.sh test --plan` only says). make demo asks for less.
DEPS_FOR ?= test
deps:
	@scripts/install-deps.sh $(DEPS_FOR)

build:
	$(CARGO) build --workspace
	$(MAKE) --no-print-directory preload-baseline

# cargo-zigbuild and zig from the project's own virtual environment when install-deps.sh
# made one, else from PATH.
ZIG_VENV := $(or $(GPUSHARE_TOOLS_DIR),$(CURDIR)/target/tools)/venv
# The baseline build replaces target/<profile>/libgpushare.so, so the demo uses the
# library that ships. Any later cargo build links cargo's own (host-glibc) build back
# there, so the tests are told where the baseline build is: GPUSHARE_PRELOAD_LIB.
preload-baseline:
	PATH="$(ZIG_VENV)/bin:$$PATH" $(CARGO) zigbuild -q -p gpushare-preload --lib --target $(BASELINE_TARGET)
	@$(MAKE) --no-print-directory check-glibc LIB=$(BASELINE_DIR)/debug/libgpushare.so
	install -m 0755 $(BASELINE_DIR)/debug/libgpushare.so $(BIN_DIR)/libgpushare.so

preload-baseline-release:
	PATH="$(ZIG_VENV)/bin:$$PATH" $(CARGO) zigbuild -q --release -p gpushare-preload --lib --target $(BASELINE_TARGET)
	@$(MAKE) --no-print-directory check-glibc LIB=$(BASELINE_DIR)/release/libgpushare.so
	install -m 0755 $(BASELINE_DIR)/release/libgpushare.so $(RELEASE_DIR)/libgpushare.so

# The highest GLIBC_ version LIB needs must not exceed the baseline.
check-glibc:
	@need=$$(objdump -T $(LIB) | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n1); \
	highest=$$(printf '%s\n%s\n' "$$need" "$(GLIBC_BASELINE)" | sort -V | tail -n1); \
	if [ "$$highest" != "$(GLIBC_BASELINE)" ]; then \
	  echo "$(LIB) needs GLIBC_$$need, newer than the baseline $(GLIBC_BASELINE)" >&2; exit 1; \
	fi; \
	echo "$(notdir $(LIB)): highest GLIBC_ version needed: $$need (baseline $(GLIBC_BASELINE))"

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@scripts/lint-deps.sh

# Unit tests, then the e2e tests against real runc/containerd/dockerd in private
# daemons (they need root and the packages `deps` installs).
test: deps lint build
	@$(MAKE) --no-print-directory check-glibc LIB=$(BASELINE_DIR)/debug/libgpushare.so
	GPUSHARE_BIN_DIR=$(BIN_DIR) GPUSHARE_PRELOAD_LIB=$(BASELINE_DIR)/debug/libgpushare.so $(CARGO) test --workspace
	@$(MAKE) --no-print-directory test-containerd-2

# The containerd 2.x lane: the suites that run containers through containerd — the shim's,
# CRI with a pod and its pause container (through the shim and through gpushare-runc as
# runc's BinaryName), and the Kubernetes stand-in's — again, against the containerd 2.3.4
# build in the shared engines directory (tests/e2e/src/engines.rs), when it is there.
# (runc_wrapper drives gpushare-runc under runc directly: no containerd in it.)
ENGINES_DIR := $(or $(GPUSHARE_ENGINES_DIR),$(abspath $(CURDIR)/../shared/engines))
test-containerd-2:
	@if [ -f "$(ENGINES_DIR)/containerd-2.3.4-linux-amd64.tar.xz" ]; then \
		echo "containerd 2.3.4 lane: the shim, CRI and Kubernetes e2e suites against $(ENGINES_DIR)"; \
		GPUSHARE_ENGINES_DIR=$(ENGINES_DIR) GPUSHARE_E2E_CONTAINERD=2.3.4 GPUSHARE_BIN_DIR=$(BIN_DIR) \
		GPUSHARE_PRELOAD_LIB=$(BASELINE_DIR)/debug/libgpushare.so $(CARGO) test -p gpushare-e2e --test shim --test cri --test kubernetes; \
	else \
		echo "containerd 2.3.4 lane SKIPPED: $(ENGINES_DIR)/containerd-2.3.4-linux-amd64.tar.xz is not there (set GPUSHARE_ENGINES_DIR)"; \
	fi

# Benchmarks measure release builds, what `make install` ships (root; real dockerd).
# The compute-isolation experiments (tests/bench, simulated GPU) write their results under
# tests/bench/results/; each benchmark writes its figures there as <bench>.json
# (GPUSHARE_BENCH_RESULTS), which gpushare-bench, run last, gathers into its control-path
# section (E4) and charts. The last run is E2-mixed with lighter jobs (every shape's CPU gap
# tripled), issue 18's second setting, in tests/bench/results/e2-mixed-light/. Memory
# reclaim (latency against bytes, and bursty inference beside training: static partition
# against reclaim) writes tests/bench/results/reclaim/.
BENCH_RESULTS := $(CURDIR)/tests/bench/results
BENCH_ENV := GPUSHARE_BIN_DIR=$(RELEASE_DIR) GPUSHARE_PRELOAD_LIB=$(BASELINE_DIR)/release/libgpushare.so GPUSHARE_BENCH_RESULTS=$(BENCH_RESULTS)
bench: deps
	$(CARGO) build --workspace --release
	$(MAKE) --no-print-directory preload-baseline-release
	$(BENCH_ENV) $(CARGO) bench --workspace
	$(BENCH_ENV) $(RELEASE_DIR)/gpushare-bench
	$(BENCH_ENV) $(RELEASE_DIR)/gpushare-bench --scenario e2-mixed --e2-mixed-gap-scale 3 \
		--out $(BENCH_RESULTS)/e2-mixed-light
	$(BENCH_ENV) $(RELEASE_DIR)/gpushare-bench --scenario reclaim

# On a machine with an NVIDIA driver: the compatibility matrix on the real GPU (the probe,
# quota, captures under token churn, long kernels, the priority pair, PyTorch, CuPy, Triton,
# memory facts), each step in its own process with its own timeout, results rewritten after
# each (tests/bench/results/gpu-check.{md,json}); a failed step exits non-zero, naming it.
# Without a driver it says so in one line and exits 0. GPU_CHECK_ARGS="--steps a,b" picks steps.
gpu-check:
	@scripts/gpu-check.sh $(GPU_CHECK_ARGS)

# The build's output goes to target/demo/build.log (its tail is shown if it fails), so what
# the demo prints is its own story. scripts/demo.sh installs what was built into a temporary
# prefix, as make install lays out a node, and runs the containers through that.
DEMO_DIR := $(CURDIR)/target/demo
demo: DEPS_FOR = demo
demo: deps
	@mkdir -p $(DEMO_DIR)
	@echo "make demo: building gpushare and its man pages (the build's log: target/demo/build.log)"
	@$(MAKE) --no-print-directory build man >$(DEMO_DIR)/build.log 2>&1 || { \
		tail -n 40 $(DEMO_DIR)/build.log; \
		echo "make demo: the build failed; its whole log is target/demo/build.log" >&2; exit 1; }
	@GPUSHARE_BIN_DIR=$(BIN_DIR) GPUSHARE_MAN_DIR=$(CURDIR)/target/man \
		GPUSHARE_COMPLETIONS_DIR=$(CURDIR)/target/completions scripts/demo.sh

# make install PREFIX=… SYSCONFDIR=… UNITDIR=… DESTDIR=…: builds the shipped crates only
# (release), the glibc-2.28 libgpushare.so and the man pages, then scripts/install-files.sh
# installs them stripped, with the configuration's and the unit's paths written for PREFIX.
# An existing $(SYSCONFDIR)/gpushare/config.toml is kept (upgrades: docs/operator-guide.md,
# "Upgrade").
SYSCONFDIR ?= /etc
UNITDIR ?= $(SYSCONFDIR)/systemd/system
SHIPPED_PACKAGES := gpushare-arbiter gpushare-oci containerd-shim-gpushare-v2 gpushare-kube
INSTALL_ENV = PREFIX=$(PREFIX) SYSCONFDIR=$(SYSCONFDIR) UNITDIR=$(UNITDIR) DESTDIR=$(DESTDIR)

install: install-build
	$(INSTALL_ENV) scripts/install-files.sh

install-build:
	@scripts/install-deps.sh --build
	$(CARGO) build --release $(addprefix -p ,$(SHIPPED_PACKAGES))
	$(MAKE) --no-print-directory preload-baseline-release
	$(MAKE) --no-print-directory man

# Stops the arbiter and removes what install put; refuses while docker, containerd or
# podman still names gpushare (gpusharectl setup --undo <engine> first; FORCE=1 anyway).
uninstall:
	$(INSTALL_ENV) FORCE=$(FORCE) scripts/uninstall.sh

# The Debian package (target/debian/gpushare_<version>_<arch>.deb), built by cargo-deb
# (pinned, installed under target/tools by scripts/install-cargo-deb.sh) from the tree
# scripts/install-files.sh stages with PREFIX=/usr: the same files as make install.
deb: install-build
	scripts/build-deb.sh

# The Kubernetes node image (target/image/gpushare-node.oci.tar, gpushare/node:<version>),
# built here with no registry and no base image: `ctr -n k8s.io images import` or
# `docker load` it on each node, or push it (deploy/kubernetes/daemonset.yaml names it).
image: install-build
	PRELOAD_LIB=$(BASELINE_DIR)/release/libgpushare.so BIN_DIR=$(RELEASE_DIR) scripts/build-image.sh

# Man pages (target/man: one per program and subcommand, and gpushare.toml.5 from the
# typed configuration) and bash/zsh/fish completions (target/completions), from the
# binaries' own command-line definitions.
.PHONY: man
man:
	$(CARGO) run -q -p gpushare-docgen -- --man-dir target/man --completions-dir target/completions

clean:
	$(CARGO) clean
