#!/usr/bin/env bash
# The prepared device run for a lent GPU (see ../shared/gpu/README.md): both benchmarks on a Qwen2.5-0.5B-shaped
# random model, for transformers' stock paged sdpa (CUDA graphs off and on) and our per-request attention.
# Each step writes JSON and a log under $OUT and has its own timeout, so one failure still leaves the others.
#
# Before the call, on the CPU machine (the device has transformers 5.17; this project needs 5.24; .whl/ is ignored):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
# Then: run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=540)
# Smoke test here (EXTRA_PYTHONPATH can point at stubs that hide gradio/datasets, which the device lacks):
#   DEVICE=cpu SHAPE=small REQUESTS=8 ANSWERS="4 8" CHATS=2 JOB_ROWS=16 OUT=/tmp/g bash bench/gpu_run.sh
# Budget: the device's 15 minutes include its start; the four steps take at most 410 s, plus the model build.
set -uo pipefail

OUT=${OUT:-/tmp/cbs-gpu}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-qwen2.5-0.5b}
REQUESTS=${REQUESTS:-256}
ANSWERS=${ANSWERS:-"32 256"}
CHATS=${CHATS:-12}
JOB_ROWS=${JOB_ROWS:-1024}
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || echo "wheel install failed"
  export PYTHONPATH=${EXTRA_PYTHONPATH:-}/tmp/site:.
else
  export PYTHONPATH=${EXTRA_PYTHONPATH:-}.
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "from bench.common import build_shape_model; print(build_shape_model('$SHAPE'))" > "$OUT/build.log" 2>&1 \
  || { echo "model build failed"; tail -20 "$OUT/build.log"; exit 1; }

step() {  # step NAME MODULE ARGS...: run one benchmark, keep its JSON and log, print its last lines
  local name=$1; shift
  timeout "$STEP_TIMEOUT" python3 -m "$@" --shape "$SHAPE" --device "$DEVICE" --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
  grep -E "tok/s|^engine|^raw|^padded|idle engine|during|loaded / idle|Error" "$OUT/$name.log" | tail -8
}

# Most important first; each step has its own timeout (in seconds) so that all fit one 540 s call.
# Throughput: (a) engine (b) raw CB same settings (c) padded generate (d) raw CB with stock sdpa, in one process.
STEP_TIMEOUT=150 step throughput_ours bench.throughput --attn-implementation cbs_varlen --requests "$REQUESTS" \
  --answer-tokens $ANSWERS --repeats 1 --padded-batch-size 64
# The stock path with CUDA graphs (FACTS.md: +20% for paged sdpa on the H200); (d) above is the same without.
STEP_TIMEOUT=100 step throughput_sdpa_graphs bench.throughput --attn-implementation sdpa --cuda-graph on \
  --requests "$REQUESTS" --answer-tokens $ANSWERS --repeats 1 --skip-padded --skip-stock
# Latency: chat TTFT on an idle engine and during a dataset job, for both attention paths.
STEP_TIMEOUT=80 step latency_ours bench.latency --attn-implementation cbs_varlen --chats "$CHATS" --job-rows "$JOB_ROWS"
STEP_TIMEOUT=80 step latency_sdpa bench.latency --attn-implementation sdpa --chats "$CHATS" --job-rows "$JOB_ROWS"
ls -la "$OUT"
