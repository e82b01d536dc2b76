# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast serve install clean wheel-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install -q -e ".[dev]"
	# constrained decoding: xgrammar's native library, without the torch it declares (server/structured)
	$(BIN)/python -m pip install -q --no-deps xgrammar==0.2.9
	touch $(STAMP)

install: $(STAMP)

# two workers, whole modules each (module fixtures are built once): compiles are single-threaded
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The wheel, installed (not editable) in a fresh temporary venv: console script, API, every module.
wheel-check: $(STAMP)
	bash .ci/wheel-check $(BIN)/python

# Host-only tests (no compiled model step), about half a minute on 2 cores; `make test` stays the full suite.
TEST_FAST := tests/test_cache_manager.py tests/test_sampler.py tests/test_prefix_identity.py \
	tests/test_prefix_cache.py tests/test_chat.py tests/test_tokenizer.py tests/test_auth.py \
	tests/test_recipe.py tests/test_config.py tests/test_full_preset.py tests/test_mxfp4.py \
	tests/test_safetensors_io.py tests/test_bench_client.py tests/test_pd_destination.py tests/test_roofline.py \
	tests/test_shared_secret.py tests/test_declared_dependencies.py tests/test_notebooks.py \
	tests/test_import_graph.py tests/test_model_identity.py tests/test_pd_auth.py tests/test_pd_budget.py
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(TEST_FAST)

serve: $(STAMP)
	$(BIN)/k3serve serve

clean:
	rm -rf $(VENV) build *.egg-info
