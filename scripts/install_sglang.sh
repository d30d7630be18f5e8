#!/usr/bin/env bash
# Create .venv-sglang: a venv with SGLang on the CPU, for the HiCache backend's engine tests and
# `tiered-cache bench sglang` (called by make). SGLang's wheel pins a CUDA stack (flashinfer,
# cuda-python, sglang-kernel, deep-ep, ...) that has no use and no CPU build here, so:
#   - torch==2.13.0 first and alone (the CPU build; SGLang pins 2.14.1, a CUDA one),
#   - sglang with --no-deps, pinned, then the dependencies a text model needs by name,
#     pinned where SGLang pins them (pip check then names the CUDA pins it skipped: harmless),
#   - this project, editable, with only the runtime parts SGLang does not bring.
# What the CPU engine still lacks (two sgl-kernel helpers, a KV copy, torchvision, pinned host
# memory) is stood in for by tests/sglang_engine/ at start-up, never by the backend.
# Overrides: PYTHON, SGLANG_SPEC (default sglang==0.5.23), TORCH_SPEC (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-sglang
# pip's resolver then lists every CUDA pin of SGLang's it did not install: expected, said once instead.
quiet() { grep -v -e "^WARNING: Location '" -e "^sglang [0-9.]* requires " -e "dependency resolver does not currently" \
          -e "^ERROR: pip's dependency resolver" || true; }

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV (SGLang on the CPU) with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import sglang.srt.server_args, transformers, xgrammar" 2>/dev/null; then
    echo "==> installing ${TORCH_SPEC:-torch==2.13.0}, then ${SGLANG_SPEC:-sglang==0.5.23} and its CPU dependencies"
    $PIP install -q "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | quiet
    $PIP install -q --no-deps "${SGLANG_SPEC:-sglang==0.5.23}" 2>&1 | quiet
    $PIP install -q \
        "transformers==5.19.0" "tokenizers==0.23.2" "xgrammar==0.2.7" "sentencepiece==0.2.1" \
        "compressed-tensors==0.18.0" "openai==2.8.0" "openai-harmony==0.0.4" "blobfile==3.0.0" \
        "llguidance>=1.7.6,<2" "apache-tvm-ffi==0.1.11" aiohttp fastapi "uvicorn>=0.51" uvloop \
        orjson pybase64 pydantic python-multipart "pyzmq>=25.1.2" requests psutil setproctitle \
        "prometheus-client>=0.20.0" msgspec numpy scipy tiktoken einops interegular \
        partial_json_parser packaging pillow regex tqdm xxhash zstandard gguf safetensors \
        huggingface_hub watchfiles distro easydict "python-dateutil<3" anthropic IPython \
        "mistral_common>=1.11.5" modelscope datasets nvidia-ml-py "soundfile==0.13.1" "torch==2.13.0" 2>&1 | quiet
    echo "    (SGLang's CUDA pins are left out on purpose: pip check names them)"
fi
$PIP install -q --no-deps -e . 2>&1 | quiet
$PIP install -q lz4 google-crc32c "crc32c>=2.4" "redis[hiredis]>=5.0" grpcio grpcio-health-checking \
    "protobuf>=4" "blosc2>=3.0" "rich>=13" pyyaml "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3" 2>&1 | quiet
"$VENV/bin/python" -c "import sglang, tiered_cache.integrations.sglang.backend; print('    sglang', sglang.__version__)"
