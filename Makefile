# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (see scripts/install.sh).

VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
VLLM_STAMP := .venv-vllm/.installed
SGLANG_STAMP := .venv-sglang/.installed
SGLANG_PYTEST := .venv-sglang/bin/python -m pytest -p no:cacheprovider

.PHONY: demo test test-long test-sglang test-vllm test-serve lint fmt bench check-kernels clean install install-vllm install-sglang wheel

$(STAMP): pyproject.toml setup.py tiered_cache/wire/_checked_copy.c scripts/install.sh
	bash scripts/install.sh
	@touch $@

install: $(STAMP)

# A second venv with vLLM (CPU build) for the connector's tests and `bench vllm`.
$(VLLM_STAMP): pyproject.toml scripts/install_vllm.sh
	bash scripts/install_vllm.sh
	@touch $@

install-vllm: $(VLLM_STAMP)

# A third venv with SGLang (CPU torch, no CUDA stack) for the HiCache backend's tests and `bench sglang`.
$(SGLANG_STAMP): pyproject.toml scripts/install_sglang.sh
	bash scripts/install_sglang.sh
	@touch $@

install-sglang: $(SGLANG_STAMP)

# Two instances, one store server, one long document: instance B reuses A's KV instead of prefilling.
demo: $(STAMP)
	$(BIN)/tiered-cache demo

# The suite, then the SGLang backend's contract tests in SGLang's venv (its engine tests: test-sglang).
test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) lint check-kernels
	$(BIN)/python -m pytest
	$(SGLANG_PYTEST) tests/integrations/test_sglang_backend.py

# Two real SGLang servers (CPU engine) sharing prefixes through a real store server (CI runs it
# after `make test`: its servers' start-up alone would take the suite past its time budget).
test-sglang: $(STAMP) $(SGLANG_STAMP)
	$(SGLANG_PYTEST) --engines tests/integrations/test_sglang_engine.py

# Real vLLM instances (CPU build, .venv-vllm) sharing prefixes through a real store server through
# our connector (CI runs it after `make test`: each instance starts an engine, too slow for the suite).
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest --engines -p no:cacheprovider tests/integrations/test_vllm_connector.py

# The Ray Serve LLM application of `cluster start --engine vllm` (2 vLLM replicas on the CPU, our
# connector, router and front end): run with the vLLM venv's Python, which has Ray Serve (~5 min).
test-serve: $(STAMP) $(VLLM_STAMP)
	.venv-vllm/bin/python -m pytest --engines -p no:cacheprovider tests/workers/serve_llm/

# The tests marked `long` (CI runs them after `make test`): the real `ray up
# deploy/cluster-local.yaml` over SSH to a user of its own on this machine (as root: it adds the
# user and starts sshd; apart from `make test`, whose Ray cluster it must not meet), and soaks
# past the suite's time budget (a store server's memory under millions of small pages); then `ray up`
# with engine vllm from .venv-vllm (the node's Python sees vLLM's CPU build there).
test-long: $(STAMP) $(VLLM_STAMP)
	bash scripts/install_long_tests.sh
	$(BIN)/python -m pytest --long -m long -p no:cacheprovider
	.venv-vllm/bin/python -m pytest --long -m long -p no:cacheprovider tests/deploy/test_ray_up_vllm.py

# The wheel `ray up` mounts on every node (deploy/cluster.yaml): dist/tiered_cache-<version>-py3-none-any.whl,
# pure Python (TIERED_CACHE_PURE=1: no native page copy, so one wheel fits every node's Python).
# build/ goes too: setuptools copies all of build/lib into the wheel, stale packages included (an
# older build's top-level workers/, before it was mapped to tiered_cache.workers).
wheel: $(STAMP)
	rm -rf dist build && TIERED_CACHE_PURE=1 $(BIN)/pip wheel --no-deps --no-build-isolation -q -w dist .

lint: $(STAMP)
	$(BIN)/ruff check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .

# Every benchmark, each beside its same-run baseline (about 10 minutes on 2 cores).
bench: $(STAMP)
	for b in keys radix tensor engine host disk redis codec remote pool-load ttft int8 store-traffic; do $(BIN)/tiered-cache bench $$b || exit 1; done

# Every CUDA source must compile for sm_90, so a syntax error cannot land (skipped without nvcc).
check-kernels:
	@if ls kernels/*.cu >/dev/null 2>&1; then \
		if command -v nvcc >/dev/null 2>&1; then \
			for f in kernels/*.cu; do echo "nvcc $$f"; nvcc -arch=sm_90 -c -o /dev/null "$$f" || exit 1; done; \
		else echo "check-kernels: nvcc not found, skipped"; fi; \
	else echo "check-kernels: no .cu files yet"; fi

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
