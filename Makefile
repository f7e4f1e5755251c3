# The two set-up commands of the README. Each creates .venv and installs what it needs (the CPU
# build of torch via constraints-cpu.txt) on a fresh machine, then runs.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install wheelhouse clean

$(STAMP): pyproject.toml setup.py constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The tiny two-stage continued pretraining on the bundled corpus, on the CPU.
demo: $(STAMP)
	$(VENV)/bin/dsa-train

# The whole CPU test suite. Deselected: GPU-only tests (run them with `-m gpu` on a GPU) and
# the benchmark-scale `long` check (tens of minutes on 2 cores; run it with `-m long`). Writes the
# slowest 25 test phases, the wall time and the time per tier to docs/test-durations.txt.
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -m "not gpu and not long" -q --durations-file=docs/test-durations.txt

# The unit tier: no process started, no trainer run, nothing marked slow (minutes on 2 cores).
test-fast: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -m "not integration and not slow and not gpu and not long" -q

# Offline install on a cluster image that has its own CUDA torch and Triton (docs/install.md): on
# the image run `python scripts/make_wheelhouse.py --probe`, then here, on a connected machine:
#   make wheelhouse IMAGE="<the flags it printed>" [EXTRAS=] [WHEELHOUSE=dir]
# EXTRAS=train (default) adds what training runs need; EXTRAS= gives the core only (gpu-check).
WHEELHOUSE ?= wheelhouse
EXTRAS ?= train
wheelhouse:
	@test -n "$(IMAGE)" || { echo 'make wheelhouse: set IMAGE="--python-version ... --platform ... --torch ... --triton ..." (what `python scripts/make_wheelhouse.py --probe` prints on the image)' >&2; exit 2; }
	$(PYTHON) scripts/make_wheelhouse.py --out $(WHEELHOUSE) --extras "$(EXTRAS)" $(IMAGE)

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
