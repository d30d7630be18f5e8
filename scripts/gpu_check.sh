#!/usr/bin/env bash
# The GPU path in one go, on a machine with CUDA, CuPy and torch (e.g. an H100 or H200):
# compile every kernel for sm_90, run the `gpu` tests,
# then `bench kernels` (with the vLLM connector's save and load), `bench gpu` (TTFT on the
# Llama-3.1-8B shape with random weights at 2k/8k/32k tokens), `bench gpu` on the Llama-3-70B
# shape cut to the layers that fit (8k), the store-hit and device-hit profiles
# (scripts/profile_*.py), the CPU tests with CUDA present, the kernel variants
# (scripts/kernel_variants.py), and `bench engine --device cuda` beside `--device cpu`. The tests,
# `bench kernels` and the 8B serving rows at 2K/8K take ~5 minutes on an H200; the whole script
# over 10 (the serving state pins host RAM for a pool of 8 prefixes per row).
# Usage: bash scripts/gpu_check.sh [OUTDIR [PART...]]   (logs land in OUTDIR, default ./gpu-check)
# PARTs (default: all, in this order): tests kernels serving warm 70b 32k profiles cpu-tests variants
# engine. Naming a few lets a short device call take only the figures still missing.
# Packages the machine lacks may sit as wheels in .whl/ (see docs/PERFORMANCE.md, "GPU path"), made
# on a machine with network access with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .whl grpcio==1.85.3 protobuf==7.36.2 lz4 google-crc32c crc32c redis
# hiredis grpcio-health-checking` and, for the Redis rows, `mkdir .whl/redis; cp $(which
# redis-server) /lib/x86_64-linux-gnu/{liblzf.so.1,libjemalloc.so.2,libatomic.so.1} .whl/redis/`.
set -uo pipefail
out=${1:-gpu-check}
shift || true
parts=" ${*:-tests kernels serving warm 70b 32k profiles cpu-tests variants engine} "
wants() { [[ $parts == *" $1 "* ]]; }
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
# A redis-server carried beside the wheels (its binary and the libraries the device image lacks:
# liblzf, libjemalloc, libatomic) gives `bench gpu` its Redis row.
if [ -x .whl/redis/redis-server ]; then
    export PATH=$PWD/.whl/redis:$PATH LD_LIBRARY_PATH=$PWD/.whl/redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONUNBUFFERED=1
# The native page copy (tiered_cache/wire/_checked_copy.c) built in place, where a compiler and
# Python's headers are at hand; without it the numpy fallback runs (the log says which).
python3 setup.py -q build_ext --inplace >"$out/native_build.log" 2>&1 || tail -5 "$out/native_build.log"
python3 -c "from tiered_cache.wire.checked_copy import NATIVE; print('native page copy:', NATIVE)"
cli() { python3 -m tiered_cache.cli.main "$@"; }
status=0
# step LOG CMD...: run CMD, its output on the terminal and appended to $out/LOG; remember failures.
step() {
    local log=$1; shift
    local t0=$SECONDS
    echo "== $*" | tee -a "$out/$log"
    "$@" 2>&1 | tee -a "$out/$log"
    local rc=${PIPESTATUS[0]}
    echo "-- ${rc} after $((SECONDS - t0)) s: $*" | tee -a "$out/steps.log"
    if [ "$rc" != 0 ]; then echo "!! failed ($rc): $*"; status=1; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.get_device_name())"
# Ordered by what the issues' bars need first, so a run cut off by the device's time limit still
# brings back the figures that matter: the gpu tests, then bench gpu on the 8B shape.
if wants tests; then
    for f in kernels/*.cu; do step gpu_tests.log nvcc -arch=sm_90 -c -o /dev/null "$f"; done
    step gpu_tests.log python3 -m pytest -p no:cacheprovider -q -rs tests/device/test_kernels_gpu.py tests/cache/test_cache_gpu.py \
        tests/device/test_host_copy.py tests/device/test_arena_copy.py tests/integrations/test_vllm_block_copy.py \
        tests/device/test_pinned.py
fi
# The kernels beside the plain copies, and the vLLM connector's save and load (its CUDA path).
wants kernels && step bench_kernels.txt cli bench kernels
# The serving state (a new prefix per round into a full pool of 8) is the headline; at 32k its pool
# leaves an 80 GB card room for fewer layers, so that length runs on its own. The warm state beside it.
wants serving && step bench_gpu.txt cli bench gpu --model llama-3.1-8b --tokens 2048,8192
wants warm && step bench_gpu.txt cli bench gpu --model llama-3.1-8b --tokens 8192 --state warm
wants 70b && step bench_gpu.txt cli bench gpu --model llama-3-70b --tokens 8192 --rounds 2 --rows device,host,store,disk
wants 32k && step bench_gpu.txt cli bench gpu --model llama-3.1-8b --tokens 32768 --rows host,store,disk --pool-prefixes 4 --rounds 2
if wants profiles; then
    step profile.txt python3 scripts/profile_store_hit.py --tokens 8192
    step profile.txt python3 scripts/profile_device_hit.py --tokens 32768
fi
wants cpu-tests && step cpu_tests_with_cuda.log python3 -m pytest -p no:cacheprovider -q tests/device/test_offload.py tests/device/test_pool.py tests/cache/test_cache.py \
    tests/cache/test_cache_engine_path.py tests/cache/test_cache_machine.py tests/device/test_kernels_cpu.py tests/device/test_allocator.py \
    tests/tiers/test_host_tier.py tests/tiers/test_disk_tier.py tests/tiers/test_tier_chain.py tests/wire/test_codec.py \
    -k 'not blosc2'  # blosc2 (an optional codec's package) is not on the device machine
if wants variants; then
    step bench_kernels.txt cli bench kernels --model smollm2-135m --pages 4096
    step kernel_variants.txt python3 scripts/kernel_variants.py
fi
if wants engine; then
    for device in cuda cpu; do
        step bench_engine.txt cli bench engine --device "$device" --below none --requests 200
    done
fi
exit $status
