# The two commands a new user runs: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench venv clean

venv: $(STAMP)

# torch is installed explicitly, pinned to the tested version, before the package (whose
# `torch` extra takes a compatible range, and a newer torch downloads gigabytes). From the
# configured package indexes; `make TORCH_INDEX=URL` adds a wheel index (a CPU build's).
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
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
