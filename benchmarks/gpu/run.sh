#!/usr/bin/env bash
# The prepared GPU check (issue 59 item 5: one GPU call that settles it), at most 8 minutes on one H100 with the
# machine's own torch/timm/triton (nothing installed, no network), compiles included. Sections, in this order, each
# one subprocess under its own deadline (its budget, cut to what is left of the run's):
#
#   versions     python, torch, timm, triton, CUDA, the GPU
#   gate         a. the Triton kernel and the per-head op against the einsum reference (float32, bf16, float16,
#                   plain and transposed, grids 14x14, 20x18, 64x64, 0/1/11 prefix tokens, batch 1 and 32, forward
#                   and the gradients of the values and the four factors): benchmarks/gpu/mixer_check.py --section gate
#   tests           every CUDA test (tests/test_cuda.py; benchmarks/gpu/run_tests.py where pytest is missing)
#   ops          b. every mixing path against SDPA with each backend forced, CUDA events, fwd and fwd+bwd, bf16 and
#                   float16, measured / predicted (benchmarks/gpu_cost_model.py)
#   sweep        c. the Triton kernel's BI / BD / warps at 1024 px, batch 32
#   models_1024  d. whole models at 1024 px (the ODE sweep: ssog, steered, einsum, fused, eager, floor), then
#   models_224      at 224 px (ODE, discrete and looped), then
#   train_32        training images/s, eager against compiled bf16 (benchmarks/train_throughput.py, 32 px)
#   profile      e. torch.profiler tables of one forward and one training step, 1024 px, batch 32, small width
#
# The Triton rows of ops and sweep run only when the gate passed (OUT_DIR/gate.status). The exit status is non-zero
# when any section failed, timed out or was skipped for want of time; summary.md opens with the gate's table, then
# every section's status. Everything the run writes stays under OUT_DIR, caches included (Triton's, inductor's,
# CUDA's, TMPDIR); at the end OUT_DIR holds summary.md, results.tgz (every section's files and logs) and
# triton_cache.tgz (Triton's cache; its sources only when the whole would pass 15 MiB): at most 8 files.
#
#   bash benchmarks/gpu/run.sh OUT_DIR            # on the GPU machine, from anywhere in the checkout
#   bash benchmarks/gpu/run.sh OUT_DIR --dry-run  # every section on the CPU at toy sizes (a test)
#   bash benchmarks/gpu/run.sh OUT_DIR --plan     # the sections and their budgets, nothing run (--plan --dry-run:
#                                                 # the dry run's)
#
# Environment: GPU_RUN_SECONDS (the run's deadline, default 465), GPU_BUDGET_<section> (a section's seconds),
# GPU_RUN_DRY_SCALE (a dry run's default budgets and deadline times this, default 3), GPU_RUN_SECTIONS (run only
# these, in the fixed order), GPU_RUN_INJECT ('<section>=fail' or '<section>=hang', space-separated: the section's
# command replaced, for tests/test_gpu_check.py).
set -u
OUT=${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR [--dry-run | --plan [--dry-run]]}
MODE=${2:-}
USAGE='usage: bash benchmarks/gpu/run.sh OUT_DIR [--dry-run | --plan [--dry-run]]'
# an option where OUT_DIR belongs would make the folder the run clears and writes the option's name
case "$OUT" in -*) echo "$USAGE (OUT_DIR first, got $OUT)" >&2; exit 2;; esac
case "$MODE" in ''|--dry-run|--plan) ;; *) echo "$USAGE (unknown option $MODE)" >&2; exit 2;; esac
DRY=0
if [ "$MODE" = "--dry-run" ] || [ "${3:-}" = "--dry-run" ]; then DRY=1; fi

SECTIONS=(versions gate tests ops sweep models_1024 models_224 train_32 profile)
# seconds per section: the gate compiles the Triton kernel about 48 times (3 dtypes, 4 orientations, 4 grid shapes)
declare -A BUDGET=([versions]=15 [gate]=120 [tests]=75 [ops]=65 [sweep]=40 [models_1024]=40 [models_224]=25
                   [train_32]=45 [profile]=30)
TOTAL=465  # the whole run; the device call's 8 minutes leave the rest to packing and start-up
# a dry run keeps every deadline, stretched for a shared 2-core CPU (imports alone take 10 s there)
SCALE=1
if [ "$DRY" = 1 ]; then SCALE=${GPU_RUN_DRY_SCALE:-3}; fi
for s in "${SECTIONS[@]}"; do
  v="GPU_BUDGET_$s"
  BUDGET[$s]=${!v:-$(( BUDGET[$s] * SCALE ))}
done
TOTAL=${GPU_RUN_SECONDS:-$(( TOTAL * SCALE ))}
if [ "$MODE" = "--plan" ]; then
  sum=0
  for s in "${SECTIONS[@]}"; do echo "$s ${BUDGET[$s]}"; sum=$(( sum + BUDGET[$s] )); done
  echo "total $sum of $TOTAL"
  exit 0
fi

START=$(date +%s)  # the run's clock: every section's deadline is cut to what is left of TOTAL from here
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd) || exit 2
# nothing of an earlier run in OUT_DIR may pass for this one's
for s in "${SECTIONS[@]}"; do rm -f "$OUT/$s.md" "$OUT/$s.log"; done
rm -rf "$OUT/cache" "$OUT"/{gate.status,gate_cases.md,ops.csv,profile.txt,status.md,summary.md,results.tgz} \
  "$OUT"/{triton_cache.tgz,models_1024.csv,models_1024.png,models_224.csv,models_224.png}
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# nothing written outside OUT_DIR: compiler caches and temporary files too
CACHE=$OUT/cache
mkdir -p "$CACHE/triton" "$CACHE/inductor" "$CACHE/tmp" "$CACHE/xdg" "$CACHE/mpl" "$CACHE/nv"
export TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor TMPDIR=$CACHE/tmp
export XDG_CACHE_HOME=$CACHE/xdg MPLCONFIGDIR=$CACHE/mpl CUDA_CACHE_PATH=$CACHE/nv
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1  # the Triton kernel on the CPU, in Triton's interpreter (mixer_check.py routes it)
  CHECK=(python benchmarks/gpu/mixer_check.py "$OUT" --dry-run --section)
  BENCH=(python -m timm_odevit_tools.benchmark --device cpu --precision amp_bfloat16 --out-dir "$OUT"
         --widths tiny --batch-sizes 1 --repeats 1 --warmup 0 --no-memory)
  MODELS_1024=(--prefix models_1024 --settings ode --resolutions 64 --variants ssog ssog_steer ssog_einsum fused eager
               floor)
  MODELS_224=(--prefix models_224 --settings ode discrete looped --resolutions 32)
  THROUGHPUT=(--device cpu --modes 'eager bf16' --families ssog_vit --batch-size 4 --repeats 1 --infer-img-size 0)
else
  CHECK=(python benchmarks/gpu/mixer_check.py "$OUT" --section)
  BENCH=(python -m timm_odevit_tools.benchmark --device cuda --precision amp_bfloat16 --out-dir "$OUT"
         --widths tiny small --batch-sizes 1 32 --warmup 1)
  # per-configuration caps: a slow configuration gets fewer repeats, eager maps that cannot fit are skipped
  MODELS_1024=(--prefix models_1024 --settings ode --resolutions 1024 --variants ssog ssog_steer ssog_einsum fused
               eager floor --repeats 3 --time-budget 2)
  MODELS_224=(--prefix models_224 --settings ode discrete looped --resolutions 224 --repeats 3 --time-budget 1)
  THROUGHPUT=(--device cuda --modes 'eager bf16' 'compiled bf16' --families ssog_vit --batch-size 128 --repeats 5
              --infer-img-size 0)
fi
if python -c 'import pytest' 2>/dev/null; then
  TESTS=(python -m pytest tests/test_cuda.py --ignore=tests/timm_suite -q -p no:cacheprovider -rfEs -o addopts=)
else  # the machine's own environment may lack pytest: the same tests through a stand-in
  TESTS=(python benchmarks/gpu/run_tests.py)
fi

elapsed() { echo $(( $(date +%s) - START )); }
STATUS=$OUT/status.md
echo '| section | budget s | limit s | took s | status |' > "$STATUS"
echo '|---|---:|---:|---:|---|' >> "$STATUS"
FAILED=()
SELECTED=" ${GPU_RUN_SECTIONS:-${SECTIONS[*]}} "
INJECT=" ${GPU_RUN_INJECT:-} "

# run_section NAME COMMAND...: the command under `timeout` at min(the section's budget, the run's time left),
# output to OUT_DIR/NAME.log; a non-zero exit, a timeout or no time left is a failure named in the summary
run_section() {
  local name=$1; shift
  local budget=${BUDGET[$name]} left limit rc t0 status
  case "$SELECTED" in *" $name "*) ;; *) echo "| $name | $budget | - | - | not selected |" >> "$STATUS"; return 0;; esac
  case "$INJECT" in
    *" $name=fail "*) set -- bash -c 'echo "injected failure"; exit 3';;
    *" $name=hang "*) set -- sleep 100000;;
  esac
  left=$(( TOTAL - $(elapsed) ))
  limit=$(( budget < left ? budget : left ))
  echo "# $name (budget $budget s, limit $limit s, at $(elapsed) s)"
  if [ "$limit" -lt 1 ]; then
    echo "| $name | $budget | 0 | 0 | **FAILED: skipped, the run's $TOTAL s are spent** |" >> "$STATUS"
    FAILED+=("$name")
    return 1
  fi
  t0=$(date +%s)
  # the whole process group: a section's own children (benchmark workers, compile workers) die with it
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.log"
  if [ "$rc" = 0 ]; then
    status=ok
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status="**FAILED: timed out at $limit s**"
  else
    status="**FAILED: exit $rc**"
  fi
  if [ "$rc" != 0 ]; then FAILED+=("$name"); fi
  echo "| $name | $budget | $limit | $(( $(date +%s) - t0 )) | $status |" >> "$STATUS"
  return "$rc"
}

VERSIONS_PY='
import sys, torch, timm
print("python", sys.version.split()[0], "| torch", torch.__version__, "| timm", timm.__version__,
      "| cuda", torch.version.cuda)
for mod in ("torchdiffeq", "huggingface_hub", "safetensors", "triton", "pytest"):
    try:
        print(mod, __import__(mod).__version__)
    except ImportError:
        print(mod, "missing")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.0f} GiB", "bf16",
          torch.cuda.is_bf16_supported())
else:
    print("gpu none: CPU run")
'

run_section versions python -c "$VERSIONS_PY"
run_section gate "${CHECK[@]}" gate
run_section tests "${TESTS[@]}"
run_section ops "${CHECK[@]}" ops
run_section sweep "${CHECK[@]}" sweep
run_section models_1024 "${BENCH[@]}" "${MODELS_1024[@]}"
run_section models_224 "${BENCH[@]}" "${MODELS_224[@]}"
run_section train_32 python benchmarks/train_throughput.py "${THROUGHPUT[@]}"
run_section profile "${CHECK[@]}" profile

section_md() {  # a section's Markdown, or the end of its log when it wrote none
  if [ -f "$OUT/$1.md" ]; then cat "$OUT/$1.md"
  elif [ -f "$OUT/$1.log" ]; then echo '```'; tail -n 30 "$OUT/$1.log"; echo '```'
  else echo '(not run)'; fi
}
{
  if [ "${#FAILED[@]}" = 0 ]; then verdict="every section passed"
  else verdict="FAILED: ${FAILED[*]}"; fi
  if [ "$DRY" = 1 ]; then where='CPU dry run'; else where=GPU; fi
  echo "# GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'), $where, $(elapsed) s): $verdict"
  echo
  echo '## a. correctness gate'
  echo
  section_md gate
  echo
  echo '## sections'
  echo
  cat "$STATUS"
  echo
  echo '## versions'
  echo
  echo '```'; cat "$OUT/versions.log" 2>/dev/null; echo '```'
  echo
  echo '## a. tests/test_cuda.py'
  echo
  echo '```'
  grep -E -e '(passed|failed|skipped|error|FAILED|ERROR)' "$OUT/tests.log" 2>/dev/null | tail -n 15
  echo '```'
  echo
  echo '## b. the op: every path against SDPA'
  echo
  section_md ops
  echo
  echo '## c. Triton blocks and warps'
  echo
  section_md sweep
  echo
  for f in models_1024 models_224; do
    echo "## d. whole models: $f"
    echo
    grep -h -e '^Device' "$OUT/$f.md" 2>/dev/null
    echo
    # the ratio table: the first table of the benchmark's Markdown file
    awk '/^\| setting/{t=1} t&&/^\|/{print} t&&!/^\|/{exit}' "$OUT/$f.md" 2>/dev/null
    echo
  done
  echo '## d. training images/s, compiled vs eager (benchmarks/train_throughput.py)'
  echo
  grep -e '^torch' -e '^|' "$OUT/train_32.log" 2>/dev/null
  echo
  echo '## e. profile'
  echo
  section_md profile
} > "$OUT/summary.md"

# pack what comes back: summary.md, results.tgz (every other file), triton_cache.tgz (Triton's cache)
(cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.md ! -name '*.tgz' -printf '%P\n' | sort > "$CACHE/files" &&
 tar czf results.tgz -T "$CACHE/files" && xargs rm -f < "$CACHE/files")
tar czf "$OUT/triton_cache.tgz" -C "$CACHE" triton
if [ "$(stat -c %s "$OUT/triton_cache.tgz")" -gt $(( 15 * 1024 * 1024 )) ]; then
  (cd "$CACHE" && find triton -type f \( -name '*.json' -o -name '*.ttgir' -o -name '*.ptx' \) -print0 |
   tar czf "$OUT/triton_cache.tgz" --null -T -)
fi
rm -rf "$CACHE"
cat "$OUT/summary.md"
ls -l "$OUT"
[ "${#FAILED[@]}" = 0 ]
