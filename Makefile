# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve install clean wheel-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The wheel, installed (not editable) in a fresh temporary venv: console script, API, every module.
wheel-check: $(STAMP)
	bash .ci/wheel-check $(BIN)/python

serve: $(STAMP)
	$(BIN)/k3serve serve

clean:
	rm -rf $(VENV) build *.egg-info
