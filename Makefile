# Two entry points for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TP ?= 1
PORT ?= 8000

# scripts/constraints.txt: the dependency versions the suite last passed with.
$(VENV)/.installed: pyproject.toml scripts/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c scripts/constraints.txt -e '.[test]'
	touch $@

.PHONY: install serve test lint bench
install: $(VENV)/.installed

serve: install
	$(VENV)/bin/helios-serve --tp $(TP) --port $(PORT)

test: install
	$(PY) -m pytest -n auto -q

lint: install
	$(VENV)/bin/ruff check .
