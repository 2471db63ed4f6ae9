# Two entry points for a newcomer: `make train` (the main job) and `make test`.
# Both create .venv on first use, with torch pinned to the CPU build (constraints.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mtcore-installed

.PHONY: setup test test-extended test-all test-cluster test-torch-floor torch-floor-record lint train doctor bench clean

setup: $(STAMP)

# mtcore-cuda's [triton] extra pulls mtcore-triton, which is on no package index: the
# install names its local path too, so pip resolves the extra to plugins/mtcore_triton.
$(STAMP): pyproject.toml plugins/mtcore_cuda/pyproject.toml plugins/mtcore_musa/pyproject.toml \
		plugins/mtcore_triton/pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,megatron]' -e 'plugins/mtcore_cuda[triton]' \
		-e plugins/mtcore_musa -e plugins/mtcore_triton
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

# Two pytest workers (pytest-xdist), one test file at a time each, so a module's
# fixtures are built once: on two cores much of one worker's time is a process starting
# or a rank waiting, and the other worker fills it (docs/ci.md has the timings).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
# Bytecode caches on, even where the environment turns them off (PYTHONDONTWRITEBYTECODE=1
# on the project's machines): otherwise every process the suite starts compiles mtcore's
# source again, and every pytest worker rewrites every test module's asserts again.
# The caches are __pycache__ folders next to the sources (.gitignore'd).
PYC_ON := env -u PYTHONDONTWRITEBYTECODE

test: lint
	$(PYC_ON) $(PY) -m pytest -m "not slow and not extended" $(XDIST)

# Long checks of code the default suite reaches too (the ZeRO-2/3 and zero-bubble
# equivalences, the conformance kit on cpu, the example family, Megatron-Core
# checkpoints, HF conversion by the CLI, FP8 convergence, doctor's doc blocks): kept out
# of make test so it stays under 10 minutes on two cores; CI runs them after it.
test-extended: $(STAMP)
	$(PYC_ON) $(PY) -m pytest -m "extended and not slow" $(XDIST)

test-all: lint
	$(PYC_ON) $(PY) -m pytest

# What goes wrong on a cluster, slow: a node lost and replaced, a node cut off for
# good (namespace nodes), a real two-node Slurm, a rank stopped mid-collective, a
# preempted job (SIGTERM) and a job killed mid-save. The node tests need root and
# Debian's slurmctld, slurmd, slurm-client and munge; each test says why it skips
# without them. (The default suite runs doctor on a namespace node.)
test-cluster: $(STAMP)
	$(PYC_ON) $(PY) -m pytest -m slow tests/e2e/test_multi_node.py tests/e2e/test_slurm.py \
		tests/e2e/test_rank_lifetime.py tests/e2e/test_preemption.py \
		tests/e2e/test_checkpoint_kill.py

# The default suite on the oldest supported torch (2.7.1, torch_musa's), in a second
# environment: the registry's torch 2.7.1 is its CUDA build, about 3 GB to download, so
# `make test` never builds it; .ci/run does (docs/ci.md). Its bin/ goes first on PATH,
# as an activated environment's does, for the tests that start `mtcore` and `python`.
FLOOR_VENV ?= .venv-torch-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.mtcore-installed

$(FLOOR_STAMP): pyproject.toml plugins/mtcore_cuda/pyproject.toml plugins/mtcore_musa/pyproject.toml \
		plugins/mtcore_triton/pyproject.toml constraints-torch-floor.txt
	python3 -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(FLOOR_PY) -m pip install -q -c constraints-torch-floor.txt -e '.[test]' \
		-e 'plugins/mtcore_cuda[triton]' -e plugins/mtcore_musa -e plugins/mtcore_triton
	touch $(FLOOR_STAMP)

test-torch-floor: $(FLOOR_STAMP)
	PATH="$(CURDIR)/$(FLOOR_VENV)/bin:$$PATH" $(PYC_ON) $(FLOOR_PY) -m pytest -m "not slow and not extended" $(XDIST)

# Rewrites tests/unit/torch_floor/torch_api_floor.json: the torch API surface the source
# uses, as the oldest supported torch has it (after a new torch call the floor test asks).
torch-floor-record: $(FLOOR_STAMP)
	$(FLOOR_PY) tests/unit/torch_floor/record_api.py

train: $(STAMP)
	$(VENV)/bin/mtcore train configs/default.yaml --nproc 4

doctor: $(STAMP)
	$(VENV)/bin/mtcore doctor

bench: $(STAMP)
	$(PY) benchmarks/bench_dispatch.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .ruff_cache
