# andrea — `make train` and `make test` work on a fresh machine: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PRESET ?= andrea-12m
RUN_DIR ?= runs/$(PRESET)
ARGS ?=

.PHONY: train test faults bench gpu-wheels venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# Trains (or resumes) the default model on the embedded corpus; Ctrl-C stops with a checkpoint.
train: venv
	$(PY) -m andrea train --preset $(PRESET) --run-dir $(RUN_DIR) $(ARGS)

test: venv
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# The long fault campaign: >= 200 SIGKILLs and every bad input, printed as one table.
faults: venv
	ANDREA_FAULT_KILLS=200 $(PY) -m pytest -q -s tests/faults $(ARGS)

bench: venv
	$(PY) bench/checkpoint.py --preset andrea-12m
	$(PY) bench/train.py

# Wheels the offline GPU machine lacks, for bench/gpu_check.sh (carry build/gpu_wheels to the device).
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d build/gpu_wheels tomli-w

clean:
	rm -rf $(VENV) .pytest_cache
