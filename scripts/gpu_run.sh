#!/usr/bin/env bash
# The one GPU script: build, run the `gpu` tests, time the benchmarks.
#
# Runs in the repository root of a machine with an NVIDIA GPU (the device
# tool's: `bash scripts/gpu_run.sh`, carrying .whl and build/gpu_carry).
# Results and logs go to $OUT (default ./gpu_out):
#   setup.log          GPU, driver, clocks as found; versions; build output
#   gpu_tests.log      pytest -m gpu (every test file that uses the marker)
#   small_batch.log    benchmarks/small_batch.py (dependent launches against
#                      classic ones at small batches); small_batch_h200.json
#   preload_tiles.log  benchmarks/preload_tiles.py (STAGES "tiles"): each
#                      PRELOAD_LINEAR tile's neighbours in whole few-token
#                      forwards; preload_tiles_h200.json
#   step_overhead.log  benchmarks/step_overhead.py (STAGES "overhead"): a
#                      few-token forward against the engine's graph step, per
#                      plan; step_overhead_h200.json
#   architectures.log  benchmarks/architectures.py (STAGES "archs"): MPNet's
#                      fused path, ModernBERT's plain one, against transformers;
#                      architectures_h200.json
#   engine_bench.log   benchmarks/engine.py; its JSON in engine_h200.json;
#                      smi.log: clocks, power, throttling while it ran
#   fp8_gemm.log       benchmarks/fp8_gemm.py: FP8 against fp16 products at
#                      BERT-base's projection shapes; fp8_gemm_h200.json
#   quant_gpu.log      benchmarks/quant_gpu.py, last, in the time left ($OUT is
#                      exported: it writes its JSON there)
#   e2e_*.log, e2e_gpu_<model>_<api>.json
#                      benchmarks/e2e.py per model:api in E2E_RUNS (default
#                      "bert-base:unary bert-base:stream minilm:unary");
#                      E2E_ARGS replaces its other arguments
#   latency.log        benchmarks/latency.py: a request's time by hop at low
#                      load, BERT-base, serve's default gateways and 2 batchers,
#                      batching hybrid (serve's GPU default), through the
#                      batchers only, and inline
#                      (LATENCY_ARGS adds arguments, e.g. "--cpu-affinity spread"),
#                      each layout with idle CPUs halting and spinning
#                      (LATENCY_IDLE, default "sleep spin": --idle-cpus;
#                      LATENCY_LAYOUTS, e.g. "8:2:inline", picks layouts)
# STAGES picks stages (default "tests small bench quant"; "e2e" and "latency" run
# the stack);
# BENCH_ARGS goes to benchmarks/engine.py (e.g. "--quick --models bert-base");
# GPU_TESTS_K picks gpu tests by pytest's -k (e.g. "cublaslt or direct").
# GPU_TESTS_TIMEOUT_S bounds the gpu tests stage (default 420 s).
#
# Carried, because the device machine reaches no registry:
#   .whl/             cp312 wheels of grpcio>=1.85.1 (our stubs need it; the
#                     image has 1.84), grpcio-tools, protobuf, health,
#                     reflection, opentelemetry-api, uvloop, googleapis-common-protos
#                     (google.rpc's error details); installed to /tmp/site
#   build/gpu_carry/  `python -m tests.gpu.reference build/gpu_carry`: the
#                     MiniLM checkpoint in fp16 with its tokenizer's files, and
#                     fp32 CPU references
# The GPU's clocks, power limit and MIG layout are only read, never set.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
STAGES=${STAGES:-tests small bench quant}
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=/tmp/site  # the carried wheels, installed below
export BERTH_TEST_LOGS=$OUT     # logs of the stacks tests and benchmarks start
mkdir -p "$OUT"
PY=python3

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit,mig.mode.current --format=csv
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl
  fi
  $PY -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'grpc', grpc.__version__)"
  $PY -c "import scipy, sklearn; print('scipy', scipy.__version__, 'sklearn', sklearn.__version__)" || echo "no scipy/scikit-learn: the offline baseline runs transformers directly"
  $PY services/protogen.py
  $PY setup.py -q build_ext --inplace
} > "$OUT/setup.log" 2>&1 < /dev/null
[ -d build/gpu_carry ] && export BERTH_GPU_FIXTURES=$PWD/build/gpu_carry
tail -n 3 "$OUT/setup.log"

if [[ " $STAGES " == *" tests "* ]]; then
  files=$(grep -rl "pytest.mark.gpu" tests --include='*.py' | sort)
  timeout "${GPU_TESTS_TIMEOUT_S:-420}" $PY -m pytest -m gpu -p no:cacheprovider -q -rA $files \
    ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|cosine|top-1|utilization" \
    "$OUT/gpu_tests.log" | tail -n 40
fi

if [[ " $STAGES " == *" archs "* ]]; then
  timeout 300 $PY benchmarks/architectures.py --out "$OUT/architectures_h200.json" \
    > "$OUT/architectures.log" 2>&1
  echo "architectures benchmark: exit $?"
  grep -v "^20..-" "$OUT/architectures.log" | tail -n 14
fi

if [[ " $STAGES " == *" tiles "* ]]; then
  timeout 300 $PY benchmarks/preload_tiles.py --out "$OUT/preload_tiles_h200.json" \
    > "$OUT/preload_tiles.log" 2>&1
  echo "preload tiles: exit $?"
  grep -A4 "^variant" "$OUT/preload_tiles.log" | head -n 40
fi

if [[ " $STAGES " == *" small "* ]]; then
  timeout 240 $PY benchmarks/small_batch.py --out "$OUT/small_batch_h200.json" \
    > "$OUT/small_batch.log" 2>&1
  echo "small-batch benchmark: exit $?"
  grep -v "^20..-" "$OUT/small_batch.log" | tail -n 16
fi

if [[ " $STAGES " == *" overhead "* ]]; then
  timeout 240 $PY benchmarks/step_overhead.py --out "$OUT/step_overhead_h200.json" \
    > "$OUT/step_overhead.log" 2>&1
  echo "step-overhead benchmark: exit $?"
  grep -v "^20..-" "$OUT/step_overhead.log" | tail -n 12
fi

if [[ " $STAGES " == *" bench "* ]]; then
  # Clocks, power and throttle reasons while it runs (read only), once a second.
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
    --format=csv -l 1 > "$OUT/smi.log" 2>&1 &
  smi=$!
  # shellcheck disable=SC2086
  timeout $((575 - SECONDS)) $PY benchmarks/engine.py --out "$OUT/engine_h200.json" ${BENCH_ARGS:-} \
    > "$OUT/engine_bench.log" 2>&1
  echo "engine benchmark: exit $?"
  kill "$smi"
  grep -v "^probe\|^input" "$OUT/engine_bench.log" | tail -n 90
fi

if [[ " $STAGES " == *" e2e "* || " $STAGES " == *" latency "* ]]; then
  # BERT-base-sized random weights and MiniLM, as berth model repositories.
  $PY -m benchmarks.gpu_repository build/e2e \
    ${BERTH_GPU_FIXTURES:+--minilm "$BERTH_GPU_FIXTURES/checkpoint"} \
    > "$OUT/e2e_repository.log" 2>&1 || tail -n 20 "$OUT/e2e_repository.log"
fi

if [[ " $STAGES " == *" latency "* ]]; then
  # As many gateways as `berth serve` starts beside a GPU (10 on 16 cores).
  many=$($PY -c "from services.cli.topology import default_gateways; print(default_gateways(1))")
  for layout in ${LATENCY_LAYOUTS:-$many:2:hybrid $many:2:service $many:2:inline}; do
    IFS=: read -r -a parts <<< "$layout"  # gateways:batchers:mode
    if ((${#parts[@]} != 3)); then
      # (with set -u, a missing $3 below would end the whole script)
      echo "latency: LATENCY_LAYOUTS entry '$layout' is not gateways:batchers:mode"
      continue
    fi
    set -- "${parts[@]}"
    for idle in ${LATENCY_IDLE:-sleep spin}; do
      # Eight runs of up to 200 s: keep within the device tool's 600 s, as
      # the e2e stage does, rather than be killed with the stages after.
      left=$((585 - SECONDS))
      if ((left < 60)); then
        echo "latency ($1 gateways, $2 batchers, batching $3, idle CPUs $idle): skipped, ${left}s left"
        continue
      fi
      # shellcheck disable=SC2086  # LATENCY_ARGS split into arguments on purpose
      timeout $((left < 200 ? left : 200)) $PY benchmarks/latency.py --model bert-base \
        --model-repository build/e2e/bert-base --gateways "$1" --batchers "$2" \
        --batcher-mode "$3" --idle-cpus "$idle" ${LATENCY_ARGS:-} \
        >> "$OUT/latency.log" 2>&1
      echo "latency ($1 gateways, $2 batchers, batching $3, idle CPUs $idle): exit $?"
    done
  done
  grep -v "^20..-" "$OUT/latency.log" | grep -E "calls|client|total|batch_lat|CPU" | tail -n 90
fi

if [[ " $STAGES " == *" e2e "* ]]; then
  # The whole stack on this machine: `berth serve` on the GPU, open-loop
  # single-text Embed load from client processes, offline baseline in-process.
  for run in ${E2E_RUNS:-bert-base:unary bert-base:stream minilm:unary}; do
    model=${run%%:*} api=${run##*:}
    left=$((585 - SECONDS))
    if ((left < 60)); then echo "e2e $run: skipped, ${left}s left"; continue; fi
    # shellcheck disable=SC2086
    timeout "$left" $PY benchmarks/e2e.py --model "$model" --api "$api" \
      --model-repository "build/e2e/$model" --out "$OUT/e2e_gpu_${model}_$api.json" \
      ${E2E_ARGS:---profiles stock --rps 500,2000,4000,6000,8000,10000 --duration 4 --max-requests 40000 --clients 4 --connections 6 --batch-size 128} \
      > "$OUT/e2e_${model}_$api.log" 2>&1
    echo "e2e $run: exit $?"
    grep -v "^machine\|^text mix\|^  served\|^served [0-9]" "$OUT/e2e_${model}_$api.log" | tail -n 14
  done
fi

# Last, in what is left of the device tool's 600 s per command.
if [[ " $STAGES " == *" quant "* ]]; then
  timeout 120 $PY benchmarks/fp8_gemm.py --out "$OUT/fp8_gemm_h200.json" \
    > "$OUT/fp8_gemm.log" 2>&1
  echo "fp8_gemm: exit $?"; grep -A20 "^us per product" "$OUT/fp8_gemm.log"
  left=$((570 - SECONDS))
  if ((left > 30)); then
    timeout "$left" $PY benchmarks/quant_gpu.py > "$OUT/quant_gpu.log" 2>&1
    echo "quant_gpu: exit $?"; tail -n 25 "$OUT/quant_gpu.log"
  else
    echo "quant_gpu: skipped, ${left}s left"
  fi
fi
