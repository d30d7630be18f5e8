# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (see scripts/install.sh).

VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev

.PHONY: demo test lint fmt bench check-kernels clean install

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	@touch $@

install: $(STAMP)

# Until the two-instance demo lands, the demo is the sizing calculator on two well-known models.
demo: $(STAMP)
	$(BIN)/tiered-cache size --model llama-3-70b --context 32768 --gpus 4
	@echo
	$(BIN)/tiered-cache size --model llama-3.1-8b --context 8192 --gpu-memory 24GiB

test: $(STAMP) lint check-kernels
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/tiered-cache bench keys
	$(BIN)/tiered-cache bench radix

# Every CUDA source must compile for sm_90, so a syntax error cannot land (skipped without nvcc).
check-kernels:
	@if ls kernels/*.cu >/dev/null 2>&1; then \
		if command -v nvcc >/dev/null 2>&1; then \
			for f in kernels/*.cu; do echo "nvcc $$f"; nvcc -arch=sm_90 -c -o /dev/null "$$f" || exit 1; done; \
		else echo "check-kernels: nvcc not found, skipped"; fi; \
	else echo "check-kernels: no .cu files yet"; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
