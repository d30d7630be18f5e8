#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from proto/ (tests/wire/test_protos.py fails when they are stale).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. \
    proto/tiered_cache/v1/cache.proto
echo "generated tiered_cache/v1/cache_pb2.py, cache_pb2.pyi, cache_pb2_grpc.py"
