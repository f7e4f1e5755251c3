# The two set-up commands of the README. Each creates .venv and installs what it needs (the CPU
# build of torch via constraints-cpu.txt) on a fresh machine, then runs.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The tiny two-stage continued pretraining on the bundled corpus, on the CPU.
demo: $(STAMP)
	$(VENV)/bin/dsa-train

# The whole CPU test suite. Deselected: GPU-only tests (run them with `-m gpu` on a GPU) and
# the benchmark-scale `long` check (tens of minutes on 2 cores; run it with `-m long`).
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -m "not gpu and not long" -q

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
