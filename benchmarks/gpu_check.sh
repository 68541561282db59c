#!/usr/bin/env bash
# The checks to run where a CUDA GPU is: one call, each part under its own time limit, logs and
# JSON under OUT (default benchmarks/results/gpu_check). Parts, most important first:
#   1. benchmarks/attention_device_bench.py  the TTT attention kernels: time, memory, agreement
#   2. tests/test_cuda.py                    the kernels and a TTT step on CUDA against the CPU
#   3. the tests that run the stages and the engine, here on the GPU
#   4. benchmarks/train_bench.py --length-scaling --device cuda   a Qwen3-8B draft's whole step
# Needs the package's dependencies importable (pip install -e . or PYTHONPATH) and pytest.
#   bash benchmarks/gpu_check.sh [OUT] [SECONDS]     # SECONDS: the whole budget (default 600)
set -u
cd "$(dirname "$0")/.." || exit
OUT=${1:-benchmarks/results/gpu_check}
TOTAL=${2:-600}
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || { echo "gpu_check: no CUDA GPU here"; exit 2; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(elapsed) )); }
part() {  # part NAME SECONDS COMMAND...: run it under min(SECONDS, what is left), log to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  (( limit > $(left) )) && limit=$(left)
  echo "== [$(elapsed)s] $name (up to ${limit}s)"
  if (( limit < 20 )); then echo "skipped: no time left"; return; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$OUT/$name.log"
  grep -E "^ *[0-9]+ (eager|sdpa|flex)|^\||PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/$name.log" | cut -c1-160 | tail -40
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
part attention 150 python3 benchmarks/attention_device_bench.py --out "$OUT/attention_device.json"
part test_cuda 200 python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_cuda.py
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist where installed
# shellcheck disable=SC2086
part stages_on_gpu 200 python3 -m pytest -v -p no:cacheprovider --tb=short $XDIST \
  tests/test_pipeline.py tests/test_pipeline_vl.py tests/test_extract.py tests/test_vl_target.py \
  tests/test_engine.py tests/test_engine_vl.py tests/test_planner.py tests/test_resume.py
part train_length 200 python3 benchmarks/train_bench.py --length-scaling --device cuda \
  --target benchmarks/targets/qwen3-8b --seq-lens 512,4096,8192 --tokens-per-step 16384 \
  --attentions sdpa,flex --dtypes bf16 --draft-vocab 32000 --out "$OUT/train_length_gpu.json"
echo "== [$(elapsed)s] done: $OUT"
