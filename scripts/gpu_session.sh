#!/usr/bin/env bash
# The GPU checks of a session that is lent a device machine (see README, "Tests"), in two steps:
#
#   scripts/gpu_session.sh wheels   # here: the wheels the device image lacks, into .gpu_wheels/
#   scripts/gpu_session.sh run      # on the device (its python3 holds a CUDA torch; nothing can
#                                   # be fetched there): `run` with carry [".gpu_wheels"]
#
# `run` installs the carried wheels into a private site dir (the image's CUDA torch and triton
# are kept: they are not the pinned versions, device.txt says which ran), prints what it runs
# on, runs every `gpu`-marked test, then the tests that take CUDA when it is there (Triton
# attention and allocator kernels compiled, engine parity, pinned host pools) and the PD and
# transfer tests, `scripts/bench_transfer.py` with the cuda_ipc backend, then `scripts/bench_hicache.py`,
# `bench_moe.py` (its GPTQ and FP8 experts too), `bench_decode.py` (CUDA graphs on and off) and `bench_wna16.py`
# (the GPTQ / AWQ kernel) on cuda; logs and the benchmarks' tables and plots go to $OUT (or ./gpu_out). Record the
# figures in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu_wheels

case "${1:-}" in
wheels)
    # pydantic (EngineConfig) and the transformers the parity tests pin; the image has the rest
    # of what the in-process tests import (torch, triton, numpy, msgpack, tokenizers, safetensors,
    # hypothesis, pytest). The Ray/HTTP tests are not GPU tests and stay on the CPU machine.
    "${PYTHON:-python3}" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" "pydantic>=2.5,<3" &&
    "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "transformers==5.23.0" &&
    du -sh "$WHEELS"  # ignored by git (.gitignore), so `run` must carry it
    ;;
run)
    OUT=${OUT:-gpu_out}
    SITE=/tmp/raydix-site
    mkdir -p "$OUT" "$SITE"
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$SITE:$PWD"
    python3 - <<'EOF' | tee "$OUT/device.txt"
import torch, triton, transformers, pydantic
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "pydantic", pydantic.__version__)
print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
    status=0
    # Only the files that hold `gpu` tests: collecting all of tests/ stops at the Ray, FastAPI and
    # OpenAI-client tests (the image has none of them) before a single test has run.
    gpu_files=$(grep -l "mark\.gpu" tests/test_*.py)
    python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" $gpu_files 2>&1 \
        | tee "$OUT/pytest_gpu.txt" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # CUDA branches the gpu marker does not reach: these pick cuda when it is there (compiled
    # Triton kernels, engine parity on cuda, pinned host pools); then the PD and transfer code
    # paths with CUDA present (their CPU halves run too)
    python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_attention_backends.py \
        tests/test_alloc_kernels.py tests/test_allocator_properties.py tests/test_hicache.py \
        tests/test_engine_dense.py tests/test_engine_mla.py tests/test_engine_gemma3.py \
        tests/test_engine_qwen3_next.py tests/test_fused_moe.py tests/test_engine_moe.py -k "triton or not engine" 2>&1 | tee "$OUT/pytest_cuda.txt" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_pd_workers.py tests/test_transfer.py \
        tests/test_transfer_backends.py 2>&1 | tee "$OUT/pytest_pd.txt" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    python3 scripts/bench_transfer.py --plot "$OUT/bench_transfer.png" \
        2>&1 | tee "$OUT/bench_transfer.txt" | tail -30
    python3 scripts/bench_hicache.py --device cuda 2>&1 | tee "$OUT/bench_hicache.txt" | tail -12
    python3 scripts/bench_moe.py --device cuda --shapes qwen3-30b-a3b mixtral-8x7b 2>&1 | tee "$OUT/bench_moe.txt" | tail -20
    python3 scripts/bench_moe.py --device cuda --shapes qwen3-30b-a3b --quant gptq 2>&1 | tee "$OUT/bench_moe_gptq.txt" | tail -8
    python3 scripts/bench_moe.py --device cuda --shapes qwen3-30b-a3b --quant fp8 2>&1 | tee "$OUT/bench_moe_fp8.txt" | tail -8
    python3 scripts/bench_decode.py --device cuda --plot "$OUT/bench_decode.png" 2>&1 | tee "$OUT/bench_decode.txt" | tail -10
    python3 scripts/bench_wna16.py --device cuda --plot "$OUT/bench_wna16.png" 2>&1 | tee "$OUT/bench_wna16.txt" | tail -30
    exit $status
    ;;
*)
    echo "usage: $0 wheels|run" >&2
    exit 2
    ;;
esac
