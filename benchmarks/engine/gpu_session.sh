#!/usr/bin/env bash
# One lease on the device machine (docs/perf-log/2026-11-to-12.md, GPU runs): set up, then the checks of one stage.
#   bash benchmarks/engine/gpu_session.sh stage1   # GPU-marked tests, kernel tests, batch-1 decode roofline
#   bash benchmarks/engine/gpu_session.sh stage2   # the default model's engine tests on CUDA, default and batch-invariant
#   bash benchmarks/engine/gpu_session.sh kernels  # the GPU kernel tests alone
#   bash benchmarks/engine/gpu_session.sh invariant  # the batch-invariant W4A16 path: launch sweep, int4 decode
# Carried (ignored) folders: .whl (wheels the image lacks), .gpua / .gpub (the default model in two halves, each
# under the tree limit). Everything is logged under $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$HOME/gpusite" PIP_NO_INDEX=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ ! -d "$HOME/gpusite/httpx2" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/gpusite" .whl/*.whl \
        && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
models="$HOME/.cache/edgeserve/models"; mkdir -p "$models"
part_a=.gpua/part; [ -f "$part_a" ] || part_a="$HOME/parta"  # a warm machine keeps what an earlier call left in ~
if [ -f "$part_a" ] && [ -f .gpub/part ] && [ ! -s "$models/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    cat "$part_a" .gpub/part > "$models/SmolLM2-135M-Instruct.Q4_1.gguf" && cp "$HOME"/*.verified "$models/"
fi
nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null
case "${1:-}" in
stage1)
    timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=10 --continue-on-collection-errors 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    timeout 120 python3 benchmarks/engine/gpu_decode.py --skip-throughput --skip-transformers 2>&1 | tee "$OUT/gpu_decode.log" | tail -20
    ;;
stage2)
    tests="tests/server/test_server_openai.py::test_seed_reproducible_and_n tests/server/test_server_openai.py::test_logprobs_shape
           tests/text/test_structured_output.py::test_mixed_batch_equals_each_alone"
    timeout 100 python3 -m pytest -q $tests -p no:cacheprovider 2>&1 | tee "$OUT/three_default.log" | tail -8
    EDGESERVE_BATCH_INVARIANT=1 timeout 100 python3 -m pytest -q $tests -p no:cacheprovider 2>&1 \
        | tee "$OUT/three_invariant.log" | tail -8
    timeout 170 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --continue-on-collection-errors \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    ;;
kernels)
    timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_kernels_gpu.py tests/kernels/test_kernels_w4a16.py -p no:cacheprovider \
        2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -15
    ;;
invariant)
    timeout 100 python3 benchmarks/kernels/w4a16_invariant.py 2>&1 | tee "$OUT/w4a16_invariant.log" | tail -60
    EDGESERVE_BATCH_INVARIANT=1 timeout 60 python3 benchmarks/engine/gpu_decode.py --models int4 --skip-throughput \
        --skip-transformers 2>&1 | tee "$OUT/gpu_decode_invariant.log" | tail -6
    timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_kernels_w4a16.py -p no:cacheprovider 2>&1 | tail -3
    ;;
esac
