# Everything starts from nothing: `make test` and `make quickstart` build .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup bytecode test test-unit test-distributed test-slurm device-wheel clean

SEARCH_BUILD := .build/search/stamp.json

setup: $(STAMP) $(SEARCH_BUILD)

# One pinned requirements file (torch CPU wheel + megatron-core). The repo root goes on the venv's
# path through a .pth file, so `megatron.training` merges with the installed `megatron.core`
# namespace package and the tools run from anywhere. The installed packages are then byte-compiled
# once on every core (~20 s on 2; files this Python cannot compile, such as torch's py312 test
# helpers, stay as they are): with PYTHONDONTWRITEBYTECODE set, as on CI, each process the tests
# start (torchrun ranks, tools) would otherwise compile torch's and megatron's sources again.
# Of transformers' hundreds of model families only those the converter reads are compiled.
$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --disable-pip-version-check -r requirements.txt
	$(PY) -c "import site, os; open(os.path.join(site.getsitepackages()[0], 'seq1f1b-repo.pth'), 'w').write(os.path.abspath('.') + '\n')"
	$(PY) -c "import compileall, re, site; compileall.compile_dir(site.getsitepackages()[0], quiet=2, workers=0, rx=re.compile(r'transformers/models/(?!(auto|llama|mistral|qwen2)/)'))"
	$(PY) -c "import torch, megatron.core, seq1f1b; print('setup ok: torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
	@touch $(STAMP)

# The schedule search's greedy, refine and anneal modules compiled by mypyc (1.3-1.7x faster
# searches, the same orders), rebuilt when a source of seq1f1b/plan/ changes; optional: without a C
# compiler it says so and the search runs as Python (seq1f1b/plan/schedules/compiled.py).
$(SEARCH_BUILD): $(STAMP) $(wildcard seq1f1b/plan/*.py seq1f1b/plan/*/*.py)
	$(PY) tools/build_search.py

# Two pytest workers (pytest-xdist): the torchrun and Slurm tests run one after another on one of
# them while the unit files, a group each, go to whichever is free (tests/worker_groups.py says
# why).
XDIST := -n 2 --dist loadgroup

# The repo's own sources byte-compiled before the tests, as the installed packages are at setup
# (1-3 s; then only what changed is compiled again): with PYTHONDONTWRITEBYTECODE set, as on CI,
# each of the suite's hundreds of processes (torchrun ranks, the tools the docs run) would
# otherwise compile the modules it imports again (plan.py comm: 0.66 -> 0.42 s). Python checks
# each .pyc against its source, so an edit is never shadowed.
bytecode: setup
	$(PY) -m compileall -q -j 0 seq1f1b megatron tools tests examples pretrain_gpt.py

test: bytecode
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) tests

test-unit: bytecode
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) tests/unit

test-distributed: bytecode
	$(PY) -m pytest -q -p no:cacheprovider tests/distributed

# A throwaway Slurm cluster (installed from Debian's packages when missing) runs the sbatch
# scripts of examples/slurm for real; `make test` runs these too, as part of tests/.
test-slurm: bytecode
	$(PY) -m pytest -q -p no:cacheprovider tests/slurm

# From nothing: the venv, the shipped corpus as .bin/.idx, a tiny GPT trained with Seq1F1B (k=4) on
# 4 CPU processes (TP=2 x PP=2), a checkpoint and a timeline picture, all under runs/quickstart/.
quickstart: setup
	PY=$(PY) bash examples/quickstart.sh

# megatron-core as a cp312 wheel for the lent GPU machine (Python 3.12, nothing to fetch from
# there), kept out of git in .device/: tools/gpu_suite.sh installs it on that machine.
device-wheel: setup
	$(PY) -m pip download -q --disable-pip-version-check --only-binary=:all: \
		--python-version 3.12 --no-deps -d .device megatron-core==0.16.1

clean:
	rm -rf $(VENV) .pytest_cache .build
