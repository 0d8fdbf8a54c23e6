# The two commands a new user runs: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench venv clean

venv: $(STAMP)

# torch is installed explicitly, pinned, before the package (a bare `torch` would pull a CUDA build).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[torch,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m palatine demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
