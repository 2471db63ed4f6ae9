# Two entry points for a newcomer: `make train` (the main job) and `make test`.
# Both create .venv on first use, with torch pinned to the CPU build (constraints.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mtcore-installed

.PHONY: setup test test-all lint train doctor bench clean

setup: $(STAMP)

# mtcore-cuda's [triton] extra pulls mtcore-triton, which is on no package index: the
# install names its local path too, so pip resolves the extra to plugins/mtcore_triton.
$(STAMP): pyproject.toml plugins/mtcore_cuda/pyproject.toml plugins/mtcore_musa/pyproject.toml \
		plugins/mtcore_triton/pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]' -e 'plugins/mtcore_cuda[triton]' \
		-e plugins/mtcore_musa -e plugins/mtcore_triton
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -m "not slow"

test-all: lint
	$(PY) -m pytest

train: $(STAMP)
	$(VENV)/bin/mtcore train configs/default.yaml --nproc 4

doctor: $(STAMP)
	$(VENV)/bin/mtcore doctor

bench: $(STAMP)
	$(PY) benchmarks/bench_dispatch.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
