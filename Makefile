# andrea — `make train` and `make test` work on a fresh machine: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PRESET ?= andrea-12m
RUN_DIR ?= runs/$(PRESET)
ARGS ?=

.PHONY: train test quick durations faults chaos campaign mutants bench venv venv-test clean kernels-gpu-triton \
	compile-check gpu-offline

# Two install markers: `make train` installs what training needs (andrea and its dependencies: `pip install -e .`),
# everything else here the test extras too (pytest, SeaweedFS, wandb, transformers, pandas: `.[test]`).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test

# Trains (or resumes) the default model on the embedded corpus; Ctrl-C stops with a checkpoint.
train: venv
	$(PY) -m andrea train --preset $(PRESET) --run-dir $(RUN_DIR) $(ARGS)

# A worker per core plus one (up to 4), one test file each at a time (pytest-xdist, --dist loadfile: a module's
# fixtures are built once). Since the trainers fork from a warm interpreter (tests/zygote.py) the suite spends ~1,090
# CPU-seconds, and a worker per core left a fifth of the cores idle while tests wait (a step delay, a commit window, a
# signal's grace): on 2 cores 688 s with two workers, 556 s with three (2026-12-06). --no-loadscope-reorder hands the
# files out in collection order, the longest first by the durations record (tests/durations.json;
# tests/conftest.py), so no worker is left alone on a long file at the end. --durations=12 prints the slowest tests
# of every run: what to look at when the suite grows (<= 10 min on 2 cores). The GPU code's long checks on this CPU
# run in `make gpu-offline` (below), which .ci/run runs after this.
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) + 1))")
SUITE := -m "not slow and not gpu_offline"
test: venv-test
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder $(SUITE) --durations=12 $(ARGS)

# Regenerates the durations record that orders `make test` (tests/durations.py): the suite as `make test` runs it,
# every test's time into build/durations.txt, then each file's seconds into tests/durations.json (commit it).
# ARGS=tests/e2e/test_x.py measures and updates that file's entry alone.
durations: venv-test
	@mkdir -p build
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder $(SUITE) --durations=0 \
	    $(ARGS) > build/durations.txt || true
	$(PY) -m tests.durations build/durations.txt

# The development loop: the unit tests only (no trainer process; ~1.5 min on 2 cores). `make test` runs them too,
# with everything else.
QUICK ?= tests/unit
quick: venv-test
	$(PY) -m pytest -q -n auto --maxprocesses 2 --dist load $(SUITE) $(QUICK) $(ARGS)

# The GPU code checked on this CPU at length (the tests marked gpu_offline; ~3.5 CPU-minutes, ~2 min on 2 cores):
# every Triton kernel at every launch configuration the trainer can pick compiled for sm_89
# (tests/unit/kernels/test_compile.py) and bench/gpu_check.sh's self-test, every part's real program on tiny shapes
# (tests/e2e/test_gpu_check.py). .ci/run runs it after `make test`, whose 10 minutes on 2 cores it would
# otherwise take a sixth of; run it after changing a kernel, a launcher's configuration or bench/gpu_check.sh.
gpu-offline: venv-test
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m gpu_offline $(ARGS)

# The long fault campaign: >= 200 SIGKILLs and every bad input, printed as one table.
faults: venv-test
	ANDREA_FAULT_KILLS=200 $(PY) -m pytest -q -s tests/faults $(ARGS)

# The chaos run: one andrea run meets every fault (SIGTERM, a poisoned step, SIGKILL, a hung torchrun rank, a flipped
# bit, a store outage, a full disk, the loss of the machine) under a supervisor loop as systemd runs it, with a real
# S3 server and a loopback webhook; one report: the final bytes against the same command on a perfect machine, every
# incident on the record, recovery seconds, goodput (bench/chaos.py, docs/benchmarks.md). Opt-in, like `make faults`;
# the default takes about (faults + 1) minutes twice, after the short chaos run's test (tests/e2e/test_chaos.py, a
# minute). CHAOS="--preset andrea-tiny --every 6" for a quick one.
CHAOS ?= --preset andrea-12m --every 60 --checkpoint-every 1
chaos: venv-test
	$(PY) -m pytest -q -m slow tests/e2e/test_chaos.py
	$(PY) bench/chaos.py $(CHAOS) $(ARGS)

# The seeded campaign of random fault sequences (bench/campaign.py; docs/testing.md says how to read and replay one):
# per seed, a run configuration and a sequence of faults drawn from the seed alone, each judged against the same
# commands on a perfect machine; a failing seed is shrunk and printed with the command that replays it. One table at
# the end, after the seeds it found failing replayed (tests/e2e/test_campaign.py's slow tests). Opt-in, like
# `make chaos`: SEEDS=0-199 for a long one, SEEDS=17 replays seed 17.
SEEDS ?= 0-9
campaign: venv-test
	$(PY) -m pytest -q -m slow tests/e2e/test_campaign.py
	OMP_NUM_THREADS=1 $(PY) bench/campaign.py --seeds $(SEEDS) $(ARGS)

# Mutations of the durable paths and the step boundary's order, one at a time in a scratch copy, each followed by
# the tests that should catch it: one table, exit 0 only if every one is caught (tests/mutants.py; ~7 min on 2
# cores). Opt-in, like `make faults`.
mutants: venv-test
	$(PY) -m tests.mutants $(ARGS)

# Every Triton kernel at every launch configuration compiled for sm_80, sm_89 and sm_90 on this CPU, one table
# (andrea/kernels/compile_check.py; ~1.5 min on 2 cores). `make gpu-offline` compiles for sm_89 alone.
compile-check: venv-test
	TRITON_INTERPRET=0 $(PY) -m andrea.kernels.compile_check $(ARGS)

bench: venv-test
	$(PY) bench/checkpoint.py --preset andrea-12m
	$(PY) bench/train.py

# The kernel tests (interpreter) under the GPU image's Triton, beside the pinned one that `make test` uses: a venv
# holding only triton==$(TRITON_GPU_IMAGE) and numpy<2.4 (Triton 3.6's interpreter turns shape-(1,) arrays into
# ints, which NumPy 2.4 refuses: 61 kernel tests fail for that alone), everything else read from $(VENV) through a
# .pth file. Needs the network once; ~2 min on 2 cores. Opt-in, like `make faults`.
TRITON_GPU_IMAGE ?= 3.6.0
TRITON_VENV ?= build/triton36-venv
kernels-gpu-triton: venv-test
	@test -f $(TRITON_VENV)/.installed || { \
	    $$($(PY) -c 'import sys; print(sys._base_executable)') -m venv $(TRITON_VENV) \
	    && $(TRITON_VENV)/bin/pip install --quiet "triton==$(TRITON_GPU_IMAGE)" "numpy<2.4" \
	    && $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	        > $$($(TRITON_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/andrea-venv.pth \
	    && touch $(TRITON_VENV)/.installed; }
	TRITON_INTERPRET=1 $(TRITON_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	    -W "ignore:Conversion of an array with ndim:DeprecationWarning" tests/unit/kernels $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
