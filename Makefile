# The two quick-start commands: `make demo` and `make test`. Each creates .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.capline-installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, alone: it comes from this machine's local CPU build; then everything under the lock.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded default (configs/demo.yaml), guarded so nothing leaves the machine.
demo: install
	CAPLINE_NETGUARD=1 $(BIN)/capline run configs/demo.yaml $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(ARGS)

bench: install
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf runs .pytest_cache
