#!/usr/bin/env bash
# The prepared GPU check: versions, the CUDA test subset, training images/s compiled vs eager under bf16 (issue 12's
# target) for each tiny 32 px model, then the benchmark (SSoG fixed, steered and einsum path, fused and eager dense,
# identity floor) at 224/512/1024/2048 px, tiny and small, batch 1 and 32, bf16 autocast, all in at most 8 minutes on
# one H200 with the machine's own torch/timm (nothing installed, no network).
#
#   bash benchmarks/gpu/run.sh OUT_DIR            # on the GPU machine, from anywhere in the checkout
#   bash benchmarks/gpu/run.sh OUT_DIR --dry-run  # the same steps on the CPU at 32 px, in about a minute
#
# OUT_DIR receives 8 files at most, flat: tests.txt, summary.md (with the training table), and for the ODE sweep and the discrete/looped
# sweep a CSV, a Markdown table and a PNG each. Exit status: that of the benchmark (tests may fail without
# stopping it: their result is in tests.txt and the summary).
set -u
OUT=${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR [--dry-run]}
DRY=0
if [ "${2:-}" = "--dry-run" ]; then DRY=1; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
TOTAL=${GPU_RUN_SECONDS:-470}  # the whole script, under the 8 minutes with a margin for start-up
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(elapsed) )); }

{
  echo "# versions"
  python - <<'EOF'
import sys, torch, timm
print('python', sys.version.split()[0], '| torch', torch.__version__, '| timm', timm.__version__,
      '| cuda', torch.version.cuda)
for mod in ('torchdiffeq', 'huggingface_hub', 'safetensors'):
    try:
        print(mod, __import__(mod).__version__)
    except ImportError:
        print(mod, 'missing')
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('gpu', torch.cuda.get_device_name(0), f'{p.total_memory / 2**30:.0f} GiB', 'bf16',
          torch.cuda.is_bf16_supported())
else:
    print('gpu none: CPU run')
EOF
} 2>&1 | tee "$OUT/tests.txt"

if [ "$DRY" = 1 ]; then
  DEVICE=(--device cpu); TEST_TIMEOUT=120; THROUGHPUT_SECONDS=300
  THROUGHPUT=(--device cpu --modes 'eager fp32' 'eager bf16' --families ssog_vit --batch-size 4 --repeats 1
              --infer-img-size 0)
  ODE=(--settings ode --widths tiny --resolutions 32 --batch-sizes 1 --repeats 1 --warmup 0 --no-memory)
  DEPTH=(--settings discrete looped --widths tiny --resolutions 32 --batch-sizes 1 --repeats 1 --warmup 0
         --no-memory)
else
  DEVICE=(); TEST_TIMEOUT=${GPU_TEST_SECONDS:-150}; THROUGHPUT_SECONDS=${GPU_THROUGHPUT_SECONDS:-120}
  THROUGHPUT=(--device cuda --modes 'eager bf16' 'compiled bf16' --batch-size 128 --repeats 10 --infer-img-size 0)
  # per-configuration caps: a slow configuration gets fewer repeats, eager maps that cannot fit are skipped
  ODE=(--settings ode --widths tiny small --resolutions 224 512 1024 2048 --batch-sizes 1 32 --repeats 5
       --warmup 1 --time-budget 4)
  DEPTH=(--settings discrete looped --widths tiny small --resolutions 224 512 1024 2048 --batch-sizes 1 32
         --repeats 3 --warmup 1 --time-budget 2)
fi

echo "# tests/test_cuda.py (at most ${TEST_TIMEOUT} s)" | tee -a "$OUT/tests.txt"
if python -c 'import pytest' 2>/dev/null; then
  TEST_CMD=(python -m pytest tests/test_cuda.py -q -p no:cacheprovider -rfEs)
else  # the machine's own environment may lack pytest: the same tests through a stand-in
  TEST_CMD=(python benchmarks/gpu/run_tests.py)
fi
timeout "$TEST_TIMEOUT" "${TEST_CMD[@]}" 2>&1 | tail -40 | tee -a "$OUT/tests.txt"
TESTS_RC=${PIPESTATUS[0]}
echo "tests exit status $TESTS_RC after $(elapsed) s" | tee -a "$OUT/tests.txt"

# training throughput: the rows finished within the limit are kept (each is printed when measured)
THROUGHPUT_TABLE=$(mktemp)
echo "# training throughput (at most $THROUGHPUT_SECONDS s)"
timeout "$THROUGHPUT_SECONDS" python benchmarks/train_throughput.py "${THROUGHPUT[@]}" 2>/dev/null \
  | grep -e '^torch' -e '^|' | tee "$THROUGHPUT_TABLE"

run_bench() {  # name seconds args...: one sweep, cut at its time limit; the tables it wrote so far stay
  local name=$1 limit=$2; shift 2
  echo "# benchmark $name (at most $limit s)"
  timeout "$limit" python -m timm_odevit_tools.benchmark "${DEVICE[@]}" --precision amp_bfloat16 --out-dir "$OUT" \
    --prefix "$name" "$@" 2>&1 | grep -v -e '^USDT' -e 'benchmark:' | tail -60
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] && [ -f "$OUT/$name.csv" ]; then
    echo "$name: cut at $limit s; redrawing what was measured"
    python -m timm_odevit_tools.benchmark --plot-only "$OUT/$name.csv" --out-dir "$OUT" --prefix "$name" >/dev/null
  fi
  return "$rc"
}

# the ODE sweep (the paper's headline) gets two thirds of what is left, the einsum path beside it
run_bench benchmark_ode $(( $(left) * 2 / 3 )) "${ODE[@]}" --variants ssog ssog_steer ssog_einsum fused eager floor
ODE_RC=$?
run_bench benchmark_discrete_looped $(( $(left) - 15 )) "${DEPTH[@]}"
DEPTH_RC=$?

{
  echo "# summary ($(elapsed) s in all; tests exit $TESTS_RC, ODE sweep exit $ODE_RC, discrete/looped exit $DEPTH_RC)"
  echo
  grep -h -e '^Device' "$OUT/benchmark_ode.md" 2>/dev/null
  echo
  for f in benchmark_ode benchmark_discrete_looped; do
    echo "## $f"
    # the ratio table: the first table of the Markdown file
    awk '/^\| setting/{t=1} t&&/^\|/{print} t&&!/^\|/{exit}' "$OUT/$f.md" 2>/dev/null
    echo
  done
  echo "## training images/s, compiled vs eager (benchmarks/train_throughput.py)"
  cat "$THROUGHPUT_TABLE"
  echo
  echo "## tests"
  grep -E -e '(passed|failed|skipped|error)' "$OUT/tests.txt" | tail -3
} > "$OUT/summary.md"
cat "$OUT/summary.md"
ls "$OUT"
[ "$ODE_RC" = 0 ] && [ "$DEPTH_RC" = 0 ]
