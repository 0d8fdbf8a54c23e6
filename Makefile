# The two commands a new user runs: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench venv clean

venv: $(STAMP)

# torch is installed explicitly, pinned, before the package (a bare `torch` would pull a CUDA build).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[torch,test,lint]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m palatine demo

test: $(STAMP)
	$(PY) -m pytest -q

# ruff (rules and format) and mypy --strict over src/, as configured in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
