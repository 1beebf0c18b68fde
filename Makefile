# The two quick-start commands: `make demo` and `make test`. Each creates .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.capline-installed

.PHONY: install demo test test-fast bench clean

# Debian data packages the builtin evaluation sets read; installed where apt is there and we are root.
DEBS := dataset-fashion-mnist openclipart-svg chromium wordnet-base

$(STAMP): pyproject.toml constraints.txt
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  dpkg -s $(DEBS) >/dev/null 2>&1 || apt-get install -y -q $(DEBS) >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null && apt-get install -y -q $(DEBS) >/dev/null) || \
	  echo "note: could not install $(DEBS); the fashion_mnist evaluation set, the openclipart source, the report test (chromium) and ARO's noun/adjective perturbations (wordnet-base) will be unavailable"; \
	else echo "note: install the Debian package(s) $(DEBS) for the fashion_mnist evaluation set, the openclipart source, the report test (chromium) and ARO's noun/adjective perturbations (wordnet-base)"; fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, alone: it comes from this machine's local CPU build; then everything under the lock.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded default (configs/demo.yaml), guarded so nothing leaves the machine.
demo: install
	CAPLINE_NETGUARD=1 $(BIN)/capline run configs/demo.yaml $(ARGS)

# The suite runs on TEST_WORKERS pytest-xdist workers (a test file stays on one worker: its fixtures
# are shared; the longest files first, tests/conftest.py), each in a network namespace of its own where `unshare --net` works (root): two
# workers' demo sites, MLflow and moto servers keep their fixed loopback ports. Elsewhere, one worker.
TEST_WORKERS ?= 2
NETNS_OK := $(shell unshare --net sh -c 'ip link set lo up' 2>/dev/null && echo yes)
XDIST := $(if $(NETNS_OK),--tx '$(TEST_WORKERS)*popen//python=$(CURDIR)/tests/netns_python $(CURDIR)/$(BIN)/python' --dist loadfile --no-loadscope-reorder,)

test: install
	$(BIN)/python -m pytest $(XDIST) --durations=25 $(ARGS)

# The fast set on the same workers: serially it had grown to a minute (collection alone is 7 s).
test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(ARGS)

# short non-English text for benchmarks/language_threshold.py
BENCH_DEBS := fortunes-de fortunes-es fortunes-it fortunes-br fortunes-pl fortunes-cs

bench: install
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  dpkg -s $(BENCH_DEBS) >/dev/null 2>&1 || apt-get install -y -q $(BENCH_DEBS) >/dev/null 2>&1 || true; fi
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf runs .pytest_cache
