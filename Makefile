# The two commands: `make serve` and `make test` set everything up on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: serve test lint clean bench bench-quick chaos soak mutate fuzz prometheus-bin chromium-bin venv-setup python-note

# One set-up at a time: `make serve` and `make test` started together on a fresh clone both
# made .venv, and the second failed ("No module named pip"). The second waits for the lock
# (flock, util-linux), then finds the stamp fresh and does nothing. A .venv without pip (a
# set-up interrupted while venv installed it) is made anew.
# (A second one says it waits: round 31's new user saw it wait silently.) A .venv of a Python
# older than 3.11 is made anew too, with $(PYTHON) if that is 3.11 or newer (round 49's new user:
# after a set-up with a too old python3 failed, every later one reused its .venv and failed).
$(STAMP): pyproject.toml
	@if command -v flock >/dev/null; then \
		flock -n -E 75 $(VENV).lock $(MAKE) --no-print-directory venv-setup; rc=$$?; \
		if [ $$rc = 75 ]; then echo "waiting for another make to finish setting up $(VENV) (it holds $(VENV).lock)"; \
			flock $(VENV).lock $(MAKE) --no-print-directory venv-setup; rc=$$?; fi; exit $$rc; \
	else $(MAKE) --no-print-directory venv-setup; fi

venv-setup:
	@if [ $(STAMP) -nt pyproject.toml ]; then exit 0; fi; \
	echo "setting up $(VENV): installing rpc-broker and its packages (a minute or two the first time)"; \
	set -e; \
	if ! $(BIN)/python -c 'import sys, pip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then \
		rc=0; found=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2]); sys.exit(sys.version_info < (3, 11))' 2>$(VENV).why) || rc=$$?; \
		if [ $$rc != 0 ]; then \
			if [ -n "$$found" ]; then why="is Python $$found"; else why="did not run: $$(head -c 300 $(VENV).why)"; fi; \
			rm -f $(VENV).why; \
			echo "PYTHON=$(PYTHON) $$why" >&2; \
			echo "rpc-broker needs Python 3.11 or newer: name one that runs, by name or full path, e.g. make serve PYTHON=/usr/bin/python3.12 (make test alike)" >&2; \
			exit 1; fi; \
		rm -f $(VENV).why; \
		$(PYTHON) -m venv --clear $(VENV); fi; \
	$(BIN)/python -m pip install --quiet --upgrade pip; \
	$(BIN)/python -m pip install --quiet -e '.[dev]'; \
	touch $(STAMP)

# A PYTHON given once .venv exists is not used (round 53's new user: `make serve PYTHON=python3.12`
# after a 3.11 set-up kept 3.11, silently): said, with the way to use it.
python-note: $(STAMP)
	@case "$(origin PYTHON)" in "command line"|environment) \
		have=$$($(BIN)/python -c 'import sys; print(sys.version.split()[0])'); \
		if ! want=$$($(PYTHON) -c 'import sys; print(sys.version.split()[0]); sys.exit(sys.version_info < (3, 11))' 2>/dev/null); then \
			if [ -n "$$want" ]; then why="is Python $$want, older than 3.11"; else why="did not run"; fi; \
			echo "note: PYTHON=$(PYTHON) $$why: not used; $(VENV) has Python $$have" >&2; \
		elif [ "$$want" != "$$have" ]; then \
			echo "note: PYTHON=$(PYTHON) (Python $$want) is not used: $(VENV) has Python $$have; make clean, then make again, to set it up with PYTHON" >&2; fi;; \
	esac

serve: $(STAMP) python-note
	$(BIN)/rpc-broker serve $(ARGS)

# ---- test: the suite in JOBS parallel pytest-xdist processes (most tests wait on sockets,
# timers and child processes, not on the CPU: 4 on 2 cores), then the tests marked `serial`
# (sensitive to CPU contention) in one process with none beside them. Exit status: the first
# part's failure, else the second's ("no tests ran", 5, only if neither ran one); the second
# does not start after the first was interrupted (2) or misused (3, 4). JOBS=0: the
# whole suite in one process, in order. prometheus-bin and chromium-bin, make's prerequisites,
# run once before either part: no pytest worker installs anything.
JOBS ?= 4

test: $(STAMP) python-note prometheus-bin chromium-bin
ifeq ($(JOBS),0)
	$(BIN)/python -m pytest -q $(ARGS)
else
	@set +e; \
	echo "$(BIN)/python -m pytest -q -n $(JOBS) -m 'not serial' $(ARGS)"; \
	$(BIN)/python -m pytest -q -n $(JOBS) -m 'not serial' $(ARGS); parallel=$$?; \
	case $$parallel in 2|3|4) exit $$parallel;; esac; \
	echo "$(BIN)/python -m pytest -q -m serial $(ARGS)   # the tests sensitive to CPU contention, alone"; \
	$(BIN)/python -m pytest -q -m serial $(ARGS); serial=$$?; \
	echo "make test: the parallel part exited $$parallel, the serial part $$serial (5: no test selected)"; \
	if [ $$parallel = 5 ] && [ $$serial = 5 ]; then exit 5; fi; \
	for status in $$parallel $$serial; do case $$status in 0|5) ;; *) exit $$status;; esac; done
endif

lint: $(STAMP)
	$(BIN)/ruff check broker tests benchmarks grafana fuzz
	$(BIN)/mypy

# ---- prometheus-bin: the tests run `promtool` and a real `prometheus` (Debian package
# `prometheus`), installed here when missing. The package's postinst would start a system
# prometheus daemon (init.d or systemd); a temporary policy-rc.d that answers 101 ("action
# forbidden", honoured by invoke-rc.d and deb-systemd-invoke) stops it from doing so, unless
# the machine already has one (Docker images ship it). apt-get update runs only when apt
# has no candidate for the package or its lists are stale. The package also enables its
# service at boot, listening on every interface (:9090): disabled again once installed, as
# the tests start their own prometheus on loopback (new user, round 76).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus

prometheus-bin:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null; then exit 0; fi; \
	set -e; echo "installing the Debian package prometheus (promtool, prometheus) for the tests"; \
	guard=; \
	if [ ! -e /usr/sbin/policy-rc.d ]; then \
		printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee /usr/sbin/policy-rc.d >/dev/null; \
		$(SUDO) chmod 755 /usr/sbin/policy-rc.d; guard=1; \
	fi; \
	trap 'if [ -n "$$guard" ]; then $(SUDO) rm -f /usr/sbin/policy-rc.d; fi' EXIT; \
	if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then $(SUDO) apt-get update; fi; \
	$(APT_INSTALL) || { $(SUDO) apt-get update && $(APT_INSTALL); }; \
	{ $(SUDO) systemctl disable prometheus || $(SUDO) update-rc.d prometheus disable; } >/dev/null 2>&1 || \
		echo "note: the prometheus service may start at boot: disable it with: systemctl disable prometheus"; \
	promtool --version >/dev/null

# ---- chromium-bin: tests/test_cross_site.py drives a real headless browser (Debian package
# `chromium`), installed here when missing, as prometheus-bin does (chromium starts no service).
APT_CHROMIUM := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium

chromium-bin:
	@if command -v chromium >/dev/null; then exit 0; fi; \
	set -e; echo "installing the Debian package chromium (a headless browser) for the tests"; \
	if ! apt-cache policy chromium 2>/dev/null | grep -q 'Candidate: [0-9]'; then $(SUDO) apt-get update; fi; \
	$(APT_CHROMIUM) || { $(SUDO) apt-get update && $(APT_CHROMIUM); }; \
	chromium --version >/dev/null 2>&1 || { echo "chromium was installed but does not run: chromium --version failed" >&2; exit 1; }

clean:
	rm -rf $(VENV) $(VENV).lock .pytest_cache .ruff_cache .hypothesis mutants .mutate .fuzz

# ---- bench: the broker side by side with its peers (benchmarks/run.py writes benchmarks/RESULTS.md)
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/run.py $(ARGS)

bench-quick: $(BENCH_STAMP)
	$(BIN)/python benchmarks/run.py --quick $(ARGS)

# ---- soak: benchmarks/soak.py, a broker under a steady mixed load at 70 % of its measured
# capacity for 10 minutes (ARGS='--minutes 1' for a smoke run), the RSS and descriptors of every
# process and the event loop's tasks and handles sampled every 10 s; fails if a process grows by
# 1 MiB a minute or more, or a count rises steadily. ARGS='--plot soak.png' draws them.
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py $(ARGS)

# ---- chaos: load over HTTP and NDJSON while workers are SIGKILLed and SIGSTOPped, SIGHUP comes
# twice, crash and hang are called and connections are dropped (benchmarks/chaos.py; docs/bench.md,
# "make chaos"). Every call's fate by its id; exits 1 if one was lost, answered twice or wrongly.
# Bounded: --seconds (60) of load, a final wait of seconds, and a hard deadline past which it
# SIGKILLs the broker it started. ARGS: its options, e.g. ARGS="--seconds 300 --seed 7".
chaos: $(STAMP)
	$(BIN)/python benchmarks/chaos.py $(ARGS)

# ---- mutate: mutation testing of the dispatcher core (README, "Testing"). mutmut mutates the
# modules [tool.mutmut] in pyproject.toml names, one change at a time, in a copy (mutants/), and
# runs the in-memory dispatcher tests against each; tests/mutation_report.py then counts killed,
# survived, equivalent (tests/mutation_equivalent.txt) and timeout, and fails under 90 % killed.
# Each run starts afresh (a result kept from before a test changed would be stale). MUTATE_CHILDREN:
# mutants tested at once (default: one per core).
# SCOPE (default core, the above): worker or pool mutate the worker's runtime or the pool against
# their own tests instead (tests/mutation_scopes.toml says which and why), each in .mutate/SCOPE/
# (mutmut reads only ./pyproject.toml: tests/mutation_scope.py writes one there); their score
# is printed, with no 90 % gate. SAMPLE=N: only N mutants drawn at random (tests/mutation_sample.py,
# a fixed seed; their names in mutants/sample.txt), for an estimate of the score and its 95 %
# interval in a fraction of the time; the gate applies to a full run only.
MUTATE_STAMP := $(VENV)/.installed-mutate
MUTATE_CHILDREN ?=
SCOPE ?= core

$(MUTATE_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,mutate]'
	@touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	@case "$(SAMPLE)" in "") ;; *[!0-9]*|0*) echo "SAMPLE=$(SAMPLE): expected how many mutants to draw, 1 or more (make mutate SAMPLE=300)" >&2; exit 2;; esac
ifeq ($(SCOPE),core)
	rm -rf mutants
	$(if $(SAMPLE),mkdir -p mutants && $(BIN)/python tests/mutation_sample.py $(SAMPLE) > mutants/sample.txt)
	$(BIN)/mutmut run $(if $(MUTATE_CHILDREN),--max-children $(MUTATE_CHILDREN)) $(if $(SAMPLE),$$(cat mutants/sample.txt)) $(ARGS)
	$(BIN)/python tests/mutation_report.py --fail-under 90
else
	$(BIN)/python tests/mutation_scope.py $(SCOPE)
	$(if $(SAMPLE),cd .mutate/$(SCOPE) && mkdir -p mutants && $(abspath $(BIN))/python ../../tests/mutation_sample.py $(SAMPLE) > mutants/sample.txt)
	cd .mutate/$(SCOPE) && $(abspath $(BIN))/mutmut run $(if $(MUTATE_CHILDREN),--max-children $(MUTATE_CHILDREN)) $(if $(SAMPLE),$$(cat mutants/sample.txt)) $(ARGS)
	$(BIN)/python tests/mutation_report.py --mutants .mutate/$(SCOPE)/mutants
endif

# ---- fuzz: coverage-guided fuzzing with atheris 3.0.0 (libFuzzer for Python, installed into
# .venv by the target) of the harnesses in fuzz/ (README, "Testing"): the JSON-RPC codec
# (jsonrpc_codec), the worker wire both ways (wire_frames), and bytes in through a real
# HttpProtocol (http_frontend) and StreamProtocol (ndjson_frontend) in memory. Each runs for
# FUZZ_SECONDS (default 60) in turn on its corpus, .fuzz/HARNESS/corpus, seeded from tests/data at
# its first run; fuzz/run.py prints per harness the inputs run, inputs a second, coverage (cov:
# edges, ft: features) and every crash, timeout (an input past 10 s) or slow input (past a budget
# linear in its size) it found, which libFuzzer writes to .fuzz/HARNESS/artifacts/. Exit 1 if one
# was found. `.venv/bin/python -m fuzz.keep HARNESS FILE` keeps one in tests/data/fuzz/HARNESS/,
# which the suite replays (tests/test_fuzz_regressions.py). FUZZ_HARNESSES: which (default all);
# FUZZ_PARALLEL: how many run at once (default 1). ARGS goes to libFuzzer (e.g. ARGS=-seed=1).
FUZZ_STAMP := $(VENV)/.installed-fuzz
FUZZ_SECONDS ?= 60
FUZZ_PARALLEL ?= 1
FUZZ_HARNESSES ?=

$(FUZZ_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,fuzz]'
	@touch $(FUZZ_STAMP)

fuzz: $(FUZZ_STAMP)
	$(BIN)/python -m fuzz.run --seconds $(FUZZ_SECONDS) --parallel $(FUZZ_PARALLEL) $(FUZZ_HARNESSES) $(if $(ARGS),-- $(ARGS))
