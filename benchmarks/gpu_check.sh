#!/usr/bin/env bash
# The checks to run where a CUDA GPU is: one call, each part under its own time limit, logs and
# JSON under OUT (default benchmarks/results/gpu_check), then OUT/gpu.json (benchmarks/gpu_summary.py).
# Parts, most important first (PARTS: a comma list of their names, default all):
#   test_cuda     tests/test_cuda.py: the kernels and a TTT step on CUDA against the CPU, DDP/FSDP2 on NCCL
#   extract       benchmarks/extract_bench.py: a Llama-3.1-8B-shaped target's extraction tokens/s, the
#                 store written behind the forwards and in place
#   verify        benchmarks/verify_cost_bench.py: its verify cost curve t_verify(N), N = 1..64
#   train_length  benchmarks/train_bench.py --length-scaling: its draft's whole step, sdpa and flex, and
#                 each step's top CUDA kernels (--profile)
#   attention     benchmarks/attention_device_bench.py: the TTT attention kernels alone, on rows of 4 packed
#                 documents (flex with our tiles and with torch's, which failed to compile there on an H200)
#   stages        the tests that run the stages (extract=online too), the engine and the planner, here on the GPU
#   train_vs_peer benchmarks/train_bench.py --vs-peer --device cuda: our step against speculators' (its flex
#                 and fused loss) on the 8B geometry at 4,096 and 2,048 tokens per sequence, ours alone at
#                 512 too, bf16 and fp32 (issue #19's criteria in one run; not in "all": a call of its own)
# Our dependencies the GPU image lacks travel as wheels: `make gpu-wheels` fills .cache/gpu-wheels
# (carry it); they are installed offline here, each only where it is missing, and transformers
# (SGLang's pin) where the image's is older; speculators and what it imports (peer/) for train_vs_peer only.
#   bash benchmarks/gpu_check.sh [OUT] [SECONDS] [PARTS]    # SECONDS: the whole budget (default 600)
# All parts at their limits take ~18 min: a 10-minute call reaches train_length; the rest in a
# second call (PARTS=stages,attention), both folders then merged by gpu_summary.py. On an H200 the
# first four took 6 min, attention 70 s, and the stages (8 workers where pytest-xdist is) 200 s for 95 of 114.
set -u
cd "$(dirname "$0")/.." || exit
OUT=${1:-benchmarks/results/gpu_check}
TOTAL=${2:-600}
PARTS=${3:-all}
WHEELS=${GPU_WHEELS:-.cache/gpu-wheels}
TARGET=benchmarks/targets/llama-3.1-8b
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || { echo "gpu_check: no CUDA GPU here"; exit 2; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(elapsed) )); }
wanted() { [[ ($PARTS == all && $1 != train_vs_peer) || ",$PARTS," == *",$1,"* ]]; }
part() {  # part NAME SECONDS COMMAND...: run it under min(SECONDS, what is left), log to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  (( limit > $(left) )) && limit=$(left)
  echo "== [$(elapsed)s] $name (up to ${limit}s)"
  if (( limit < 20 )); then echo "skipped: no time left"; return; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  printf '\nrc=%d\n' $? >> "$OUT/$name.log"  # on a line of its own, after a line cut off
  grep -E "^ *[0-9]+ (eager|sdpa|flex)|^\||PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/$name.log" | cut -c1-160 | tail -40
}

if compgen -G "$WHEELS/*.whl" > /dev/null; then  # by name: what the image has already stays as it is
  mapfile -t names < <(for w in "$WHEELS"/*.whl; do basename "$w" | cut -d- -f1; done)
  python3 -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" "${names[@]}" 2>&1 | tail -5
fi
carried=$(compgen -G "$WHEELS/transformers/transformers-*.whl" | head -1)
older="import sys, transformers; from packaging.version import Version as V; \
sys.exit(V(transformers.__version__) >= V(sys.argv[1].split('/')[-1].split('-')[1]))"
if [[ -n $carried ]] && python3 -c "$older" "$carried"; then  # the image's is older: the carried one,
  python3 -m pip install --quiet --no-index --find-links "$WHEELS/transformers" "$carried" 2>&1 | tail -5
fi  # with what it requires where the image's does not do
if wanted train_vs_peer && compgen -G "$WHEELS/peer/*.whl" > /dev/null; then  # the same way, missing ones only
  mapfile -t names < <(for w in "$WHEELS"/peer/*.whl; do basename "$w" | cut -d- -f1; done)
  python3 -m pip install --quiet --no-index --no-deps --find-links "$WHEELS/peer" "${names[@]}" 2>&1 | tail -5
fi
python3 benchmarks/gpu_summary.py --env "$OUT/env.json"
PYTEST=(python3 -m pytest -v -p no:cacheprovider --tb=short)
part test_cuda 240 "${PYTEST[@]}" --junitxml="$OUT/test_cuda.xml" tests/test_cuda.py
part extract 150 python3 benchmarks/extract_bench.py --config "$TARGET" --dtypes bfloat16 --writes behind in-place \
  --budgets 16384 65536 --samples 128 --min-len 256 --max-len 2048 --out "$OUT/extract_gpu.json"
part verify 60 python3 benchmarks/verify_cost_bench.py --config "$TARGET" --prefix 2048 \
  --ns 1,2,4,8,12,16,24,32,40,48,56,64 --out "$OUT/verify_cost_gpu.json"
part train_length 200 python3 benchmarks/train_bench.py --length-scaling --device cuda \
  --target "$TARGET" --seq-lens 512,4096,8192 --tokens-per-step 16384 \
  --attentions sdpa,flex --dtypes bf16 --draft-vocab 32000 --profile --out "$OUT/train_length_gpu.json"
part attention 120 python3 benchmarks/attention_device_bench.py --documents 4 \
  --impls sdpa,flex,flex-torch-tiles --out "$OUT/attention_device.json"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist where installed
# shellcheck disable=SC2086
part stages 300 "${PYTEST[@]}" $XDIST --junitxml="$OUT/stages.xml" \
  tests/test_pipeline.py tests/test_pipeline_vl.py tests/test_extract.py tests/test_vl_target.py \
  tests/test_engine.py tests/test_engine_vl.py tests/test_planner.py tests/test_resume.py tests/test_online.py
part train_vs_peer 540 python3 benchmarks/train_bench.py --vs-peer --device cuda --peer-python python3 \
  --target "$TARGET" --seq-lens 4096,2048,512 --peer-seq-lens 4096,2048 --dtypes bf16,fp32 \
  --tokens-per-step 16384 --draft-vocab 32000 \
  --out "$OUT/train_vs_peer_gpu.json"
python3 benchmarks/gpu_summary.py "$OUT" --out "$OUT/gpu.json"
echo "== [$(elapsed)s] done: $OUT"
