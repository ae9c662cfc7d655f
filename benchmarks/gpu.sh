#!/usr/bin/env bash
# The device machine's check, one call (docs/gpu.md):
#   run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=540)
# Installs the carried wheels (.whl/, `make gpu-wheels`) into a folder of its own, draws the installed
# package's layout with links (ingest/ and query/ inside actstore/, as `make view`), then runs each step
# in its own process under its own time limit, recording its exit status and log and going on whatever
# fails: the exactness tests on CUDA in float32 and bfloat16, ingest against a plain forward for three
# model geometries, the training feed into an SAE step.  One JSON, gpu-result.json, and the steps' logs,
# gpu-log.txt, go to $OUT (or --out DIR; out/gpu when neither).
#
#   bash benchmarks/gpu.sh --cpu [--skip-install] [--out DIR]   # the same steps on this CPU, tiny sizes
#
# Options: --cpu, --skip-install (use the running Python's packages), --out DIR, --total-s N (the whole
# script's limit, default 500 with the GPU, 240 with --cpu).  PYTHON names the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=gpu
INSTALL=1
OUT_DIR=${OUT:-}
TOTAL=
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --skip-install) INSTALL=0 ;;
    --out) OUT_DIR=$2; shift ;;
    --total-s) TOTAL=$2; shift ;;
    *) echo "gpu.sh: unknown option $1 (--cpu, --skip-install, --out DIR, --total-s N)" >&2; exit 2 ;;
  esac
  shift
done
OUT_DIR=${OUT_DIR:-$REPO/out/gpu}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
if [ "$MODE" = gpu ]; then TOTAL=${TOTAL:-500}; DEVICE=cuda; TINY=; else TOTAL=${TOTAL:-240}; DEVICE=cpu; TINY=--tiny; fi
START=$(date +%s)
DEADLINE=$((START + TOTAL))
WORK=$(mktemp -d "${TMPDIR:-/tmp}/actstore-gpu.XXXXXX")
mkdir -p "$WORK/status" "$WORK/parts" "$WORK/logs" "$WORK/stores" "$WORK/view/actstore"
LOG="$OUT_DIR/gpu-log.txt"
: >"$LOG"
{
  echo "mode=$MODE"
  echo "started=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git_commit=$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)"
  echo "git_dirty=$(git status --porcelain 2>/dev/null | grep -c . || true)"
  echo "code_sha256=$(find actstore ingest query benchmarks/bench_gpu.py tests -name '*.py' 2>/dev/null | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"
  echo "total_limit_s=$TOTAL"
} >"$WORK/meta.txt"

# step NAME BUDGET_S COMMAND...: run COMMAND under min(BUDGET_S, what is left of the whole limit less 15 s)
step() {
  local name=$1 budget=$2
  shift 2
  local now left rc t0 t1 secs timed_out=false
  now=$(date +%s)
  left=$((DEADLINE - now - 15))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt 5 ]; then
    printf '{"rc": null, "seconds": 0, "budget_s": %d, "timed_out": false, "note": "skipped: the whole limit is spent"}\n' \
      "$budget" >"$WORK/status/$name.json"
    echo "== $name: skipped (no time left)" | tee -a "$LOG"
    return
  fi
  echo "== $name (limit ${budget} s): $*" | tee -a "$LOG"
  t0=$(date +%s.%N)
  STEP_BUDGET_S=$budget timeout -k 5 "$budget" "$@" >"$WORK/logs/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  secs=$(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }")
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then timed_out=true; fi
  printf '{"rc": %d, "seconds": %s, "budget_s": %d, "timed_out": %s}\n' \
    "$rc" "$secs" "$budget" "$timed_out" >"$WORK/status/$name.json"
  cat "$WORK/logs/$name.log" >>"$LOG"
  echo "== $name: exit $rc after $secs s" | tee -a "$LOG"
}

# The package: the carried wheels in $WORK/site, the repository's folders drawn as the installed layout.
SITE="$WORK/site"
if [ "$INSTALL" = 1 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    step install 60 "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl
  else
    step install 5 sh -c 'echo "no .whl/*.whl here: run make gpu-wheels and carry .whl"; exit 1'
  fi
else
  echo '{"rc": null, "skipped": "--skip-install"}' >"$WORK/status/install.json"
fi
for f in "$REPO"/actstore/*; do ln -s "$f" "$WORK/view/actstore/"; done
ln -s "$REPO/ingest" "$REPO/query" "$WORK/view/actstore/"
export PYTHONPATH="$WORK/view:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 TOKENIZERS_PARALLELISM=false
export ACTSTORE_CACHE="$WORK/cache"
[ "$MODE" = cpu ] && export OMP_NUM_THREADS=1  # tiny models on a shared CPU: one thread each is fastest
B="$REPO/benchmarks/bench_gpu.py"
COMMON=(--device "$DEVICE" $TINY --work "$WORK/stores")
INGEST=()
[ "$MODE" = cpu ] && INGEST=(--run-bytes 3e5 --max-prompts 32 --max-docs 24)

step env 40 "$PY" "$B" env --out "$WORK/parts/env.json" --site "$SITE"

# a. The capture's identities and oracles on the tiny families, on the device, float32 then bfloat16
#    (tolerances: tests/helpers.py, docs/testing.md "Tolerances").  -W default: a library's deprecation
#    warning is shown, not a failure, there.
TESTS=(tests/integration/capture/test_oracles_capture.py tests/integration/capture/test_exactness.py
       tests/integration/ingest/test_import_device.py)  # the last: an import's predictions on the device
PYTEST=(-q -p no:cacheprovider -m "not slow and not real_data" -W default --durations=5)
if [ "$MODE" = cpu ]; then
  PYTEST+=(-k "llama-right and (attn_prob_equals or reconstructs_module)")  # the dry run: two tests
elif "$PY" -c "import xdist" 2>/dev/null; then
  PYTEST+=(-n 8)
fi
for dtype in float32 bfloat16; do
  step "exactness-$dtype" 90 env ACTSTORE_TEST_DEVICE="$DEVICE" ACTSTORE_TEST_DTYPE="$dtype" \
    "$PY" -m pytest "${PYTEST[@]}" --junitxml "$WORK/parts/exactness-$dtype.xml" "${TESTS[@]}"
done

# b. Ingest tokens/s against a plain forward, bf16, target and corpus mode, every kind (8B below).
step ingest-smollm2-135m 60 "$PY" "$B" ingest --model smollm2-135m "${COMMON[@]}" "${INGEST[@]}" --budget-s 60 \
  --out "$WORK/parts/ingest-smollm2-135m.json"
step ingest-llama-3.2-1b 75 "$PY" "$B" ingest --model llama-3.2-1b "${COMMON[@]}" "${INGEST[@]}" --budget-s 75 \
  --out "$WORK/parts/ingest-llama-3.2-1b.json"

# c. The training feed into an SAE step: Selection.loader against the same rows already on the device.
LOADER=()
[ "$MODE" = cpu ] && LOADER=(--rows 256 --batch 32 --steps 6 --expansion 2)
step loader 45 "$PY" "$B" loader "${COMMON[@]}" "${LOADER[@]}" --budget-s 45 --out "$WORK/parts/loader.json"

# b, last: the 8B geometry takes what is left, up to 150 s (its first store writes 14 GB of weights).
step ingest-llama-3.1-8b 150 "$PY" "$B" ingest --model llama-3.1-8b "${COMMON[@]}" "${INGEST[@]}" --budget-s 150 \
  --out "$WORK/parts/ingest-llama-3.1-8b.json"

"$PY" "$B" merge --work "$WORK" --out "$OUT_DIR/gpu-result.json" --mode "$MODE" 2>&1 | tee -a "$LOG"
echo "gpu.sh: $(($(date +%s) - START)) s in all; $OUT_DIR/gpu-result.json" | tee -a "$LOG"
rm -rf "$WORK"
