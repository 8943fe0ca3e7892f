#!/usr/bin/env bash
# The CIFAR-10 claim suite (book chapter experiments_cifar) on one multi-GPU machine, in
# calls of at most LIMIT seconds each. Run the SAME command again until it prints "claim suite
# complete"; every call resumes where the previous one stopped (checkpoints and results persist in
# the ignored folder checkpoints/keep/ on the machine's disk between calls):
#
#   KWNG_GIT_COMMIT=$(git rev-parse HEAD) GPUS=4 LIMIT=560 EPOCHS=30 bash scripts/run_cifar_gpu.sh
#
# Each call: (0) checks every prerequisite (data file, python with torch and nngeometry or its
# wheel, nvidia-smi when GPUS > 0, integer knobs, CLAIM_BUDGET_S for EPOCHS=auto) and stops with
# status 2, listing what is missing, before it writes anything; (1) installs nngeometry from .whl/
# and copies .data/cifar10_jpeg.npz to checkpoints/keep/data (decoded once, cached there); (2) first
# call only: `cifar timing` of the claim methods alone on GPU 0 (TIMING=0 skips it); (3) step-size
# selection (plan claim_select: 7 methods x 2 conditionings x 6 step sizes, SELECT_EPOCHS epochs
# each, scored on 5,000 held-out training images) until it is complete, then `cifar select`; (4)
# the claim suite (plan claim, EPOCHS epochs) with the selected step sizes; (5) `cifar check
# --suite claim`; (6) results/cifar/claim and the log tarred to $OUT/cifar_claim.tar.gz (extract it
# in the repository root: it holds results/cifar/claim/...) and copied into the tree's
# results/cifar/claim (new and changed files; nothing there is deleted).
# The runs work in the machine-local folder checkpoints/keep/work/ (ignored by git), whose
# results/cifar/claim starts as a copy of the tracked one (or of checkpoints/keep/claim, left by an
# older version of this script): tracked files are never moved or replaced by links.
# Runs stop at the deadline in the middle of an epoch and resume there exactly in the next call.
#
# Knobs: METHODS (comma list: only these methods, e.g. METHODS=sgd,adam,kwng for the core of the
# suite when the GPU budget is short; a later call with more methods adds the rest), EARLY_METHODS
# (comma list of methods whose step sizes are already selected: their claim runs start at once,
# in a sweep of their own with EARLY_PROCS workers per GPU beside the selection of the others;
# give the same list in every call of a suite), GPUS (GPUs of the machine), PROCS (workers per GPU for the claim suite; >= runs/GPUS keeps
# every run going at once), SEL_PROCS (workers per GPU for the selection), LIMIT (seconds this call
# may take before it must be tarring), EPOCHS (claim suite; fixed before its first run: the schedule
# depends on it; "auto": from the measured step times and CLAIM_BUDGET_S, the wall-clock seconds
# left for the claim suite over all remaining calls, with GAIN the throughput gain of processes
# sharing a GPU, 1.0 by default as measured in the earlier study; written once to
# results/cifar/claim/schedule.json), SELECT_EPOCHS, SELECT_SUBSET (training images per selection
# run; empty: all 45,000),
# DATA (the JPEG npz), PY, SET (run-setting overrides for every run; a finished run recorded with
# other settings is refused, so a smoke test needs a tree without those results, e.g. for a CPU one:
# SET="model=tiny batch_size=50 train_subset=150 device=cpu" SEL_SET="val_size=100" GPUS=0
# DATA=studies/cifar/data_sample/cifar10_sample.npz TIMING_MODEL=tiny TIMING_STEPS=3).
# Cost (H200 step times alone of results/cifar/claim/timing/timing.json, batch 128): SGD 8.7 ms,
# Adam 10.0 ms, KFAC 13.0 ms, KWNG-type methods 36-40 ms per step. Measured: the selection of four
# methods (48 runs of 2 epochs on 22,500 images) and twelve 30-epoch runs (four kwng, two each of
# kwng_samples_before_U and diag_Ttilde, sgd_momentum, kfac, the second sgd seed) took three calls
# of ~510 s on 4 H200 GPUs (PROCS=2 SEL_PROCS=6 EARLY_PROCS=2): ~100 GPU-minutes.
set -u
OUT=${OUT:-/tmp/out}
GPUS=${GPUS:-4}
PROCS=${PROCS:-5}
SEL_PROCS=${SEL_PROCS:-6}
LIMIT=${LIMIT:-560}
EPOCHS=${EPOCHS:-30}
SELECT_EPOCHS=${SELECT_EPOCHS:-2}
SELECT_SUBSET=${SELECT_SUBSET:-}
TIMING=${TIMING:-1}
DATA=${DATA:-.data/cifar10_jpeg.npz}
METHODS=${METHODS:-}             # comma list: run only these methods' part of both plans (a suite in parts)
EARLY_METHODS=${EARLY_METHODS:-} # comma list: claim runs of these start beside the selection
EARLY_PROCS=${EARLY_PROCS:-2}
PY=${PY:-python}
REPO=$PWD
KEEP=$REPO/checkpoints/keep      # persists between calls (ignored by git, not replaced by the sync)
WORK=$KEEP/work                  # the runs' working folder: results/cifar/claim of this machine
ROOT=$KEEP/data/cifar10_jpeg.npz

# ---- prerequisites, all checked before anything is written
missing=()
[ -f kwng/__init__.py ] && [ -f scripts/run_cifar_gpu.sh ] \
  || missing+=("run this script from the repository root (no kwng/ in $PWD)")
for v in GPUS PROCS SEL_PROCS LIMIT SELECT_EPOCHS EARLY_PROCS; do
  [[ ${!v} =~ ^[0-9]+$ ]] || missing+=("$v must be a non-negative integer, got '${!v}'")
done
[[ $SELECT_SUBSET =~ ^[0-9]*$ ]] || missing+=("SELECT_SUBSET must be empty or an integer, got '$SELECT_SUBSET'")
if [ "$EPOCHS" = auto ]; then
  [ -n "${CLAIM_BUDGET_S:-}" ] || missing+=("EPOCHS=auto needs CLAIM_BUDGET_S (seconds left for the claim suite)")
else
  [[ $EPOCHS =~ ^[1-9][0-9]*$ ]] || missing+=("EPOCHS must be a positive integer or 'auto', got '$EPOCHS'")
fi
[ -f "$ROOT" ] || [ -f "$DATA" ] || missing+=("data file $DATA not found (set DATA=...; nor a kept copy $ROOT)")
if ! command -v "$PY" >/dev/null 2>&1; then
  missing+=("python '$PY' not found (set PY=...)")
elif ! "$PY" -c "import torch" >/dev/null 2>&1; then
  missing+=("'$PY' cannot import torch")
elif ! ls .whl/nngeometry-*.whl >/dev/null 2>&1 && ! "$PY" -c "import nngeometry" >/dev/null 2>&1; then
  missing+=("nngeometry: neither a wheel .whl/nngeometry-*.whl nor an installed package")
fi
[[ $GPUS =~ ^[0-9]+$ ]] && [ "$GPUS" -gt 0 ] && ! command -v nvidia-smi >/dev/null 2>&1 \
  && missing+=("GPUS=$GPUS but nvidia-smi is not found (GPUS=0 runs on the CPU)")
[ -L results/cifar/claim ] && missing+=("results/cifar/claim is a symbolic link (left by an older version of \
this script): restore the tracked folder with 'git checkout -- results/cifar/claim' (its target stays in $KEEP/claim)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "run_cifar_gpu.sh: missing prerequisites, nothing was changed:" >&2
  for m in "${missing[@]}"; do echo "  - $m" >&2; done
  exit 2
fi

SETARG=(--set "checkpoint_dir=$REPO/checkpoints"); for kv in ${SET:-}; do SETARG+=(--set "$kv"); done
SELSET=("${SETARG[@]}"); for kv in ${SEL_SET:-}; do SELSET+=(--set "$kv"); done
mkdir -p "$OUT" "$KEEP/data" "$KEEP/logs" "$WORK/results/cifar"
LOG="$OUT/cifar_claim_log.txt"
export KWNG_GIT_COMMIT=${KWNG_GIT_COMMIT:-unknown}   # pass the commit in: the copy may have no .git
export PYTHONUNBUFFERED=1
left() { echo $(( LIMIT - SECONDS )); }
say() { echo "[${SECONDS}s] $*" | tee -a "$LOG"; }

# ---- setup (only ignored folders and $OUT are written)
. "$REPO/scripts/nngeometry_site.sh" && nngeometry_site "$REPO"
[ "$GPUS" -gt 0 ] && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$LOG"
# the machine's state: a copy (never a move) of the tracked results, made once
if [ ! -d "$WORK/results/cifar/claim" ]; then
  if [ -d "$KEEP/claim" ]; then cp -a "$KEEP/claim" "$WORK/results/cifar/claim"
  elif [ -d results/cifar/claim ]; then cp -a results/cifar/claim "$WORK/results/cifar/claim"
  else mkdir -p "$WORK/results/cifar/claim"; fi
fi
[ -f "$ROOT" ] || cp "$DATA" "$ROOT" || exit 2
cd "$WORK" || exit 2
"$PY" -c "import nngeometry, torch; print('nngeometry ok; torch', torch.__version__)" || exit 2
"$PY" -c "from studies.cifar.data import load_cifar; [load_cifar('cifar10', s, '$ROOT') for s in ('train', 'test')]" || exit 2
TIMING_METHODS=${TIMING_METHODS:-${METHODS:-claim}}  # every method of the suite, in one timing run
if [ -n "$EARLY_METHODS" ]; then  # the other methods: the selection and the main claim sweep
  ALL=${METHODS:-$($PY -c "import studies; studies.load_all(); from studies.cifar.plans import build_plan
print(','.join(dict.fromkeys(j['method'] for j in build_plan('claim', epochs=1))))")}
  METHODS=$($PY -c "e = set('$EARLY_METHODS'.split(','))
print(','.join(m for m in '$ALL'.split(',') if m not in e))")
  say "early claim methods: $EARLY_METHODS; the others: $METHODS"
fi
MARG=(); [ -n "$METHODS" ] && MARG=(--methods "$METHODS")
say "setup done (working folder $WORK)"

persist() {  # the results to $OUT and into the tree, whatever happened before
  tar czf "$OUT/cifar_claim.tar.gz" -C "$WORK" results/cifar/claim 2>/dev/null
  say "tarred: $OUT/cifar_claim.tar.gz ($(du -h "$OUT/cifar_claim.tar.gz" 2>/dev/null | cut -f1))"
  mkdir -p "$REPO/results/cifar/claim" && cp -a "$WORK/results/cifar/claim/." "$REPO/results/cifar/claim/" \
    && say "copied into $REPO/results/cifar/claim"
}
trap persist EXIT
plan_done() {  # prints 1 if every run of plan $1 is complete with the settings this call asks for
  SETS="${SELSET[*]}" $PY -c "
import os, sys
import studies
studies.load_all()
from studies.kit import guard
from studies.cifar import plans
from studies.cifar import sweep
p = plans.build_plan('$1', epochs=1, select_epochs=$SELECT_EPOCHS, data_root='$ROOT',
                     select_subset=${SELECT_SUBSET:-None}, select_val=5000,
                     methods='$METHODS'.split(',') if '$METHODS' else None)
sets = sweep._overrides([s for s in os.environ['SETS'].split() if s != '--set'])
try:
    print(int(all(sweep.is_complete({**j, **sets}) for j in p)))
except guard.ConfigMismatchError as err:  # a finished run of other settings
    print(f'refused: {err}', file=sys.stderr)
    print(2)"
}
filter() { grep -E "epoch [0-9]+:|deadline|ERROR|Error|Traceback|sweep" | tee -a "$LOG" | tail -${1:-30}; }

# ---- timing of each method alone (first call only)
TIMING_FILE=results/cifar/claim/timing/timing.json
if [ "$TIMING" = 1 ] && [ ! -f "$TIMING_FILE" ]; then
  CUDA_VISIBLE_DEVICES=0 $PY -m studies cifar timing --methods "$TIMING_METHODS" --steps "${TIMING_STEPS:-100}" \
      --warmup 10 --out "$TIMING_FILE" ${TIMING_MODEL:+--model "$TIMING_MODEL"} 2>&1 | grep -E "timing|Error" | tee -a "$LOG"
fi
TARG=(); [ -f "$TIMING_FILE" ] && TARG=(--timing "$TIMING_FILE")

# ---- claim runs of methods selected earlier, beside the selection (to the same deadline)
EARLY_PID=
if [ -n "$EARLY_METHODS" ] && [ "$(left)" -gt 60 ]; then
  say "early claim runs ($EARLY_METHODS): starting (deadline in $(( $(left) - 30 ))s)"
  ( $PY -m studies cifar sweep --plan claim --epochs "$EPOCHS" --gpus "$GPUS" --procs-per-gpu "$EARLY_PROCS" \
      --methods "$EARLY_METHODS" --data-root "$ROOT" "${TARG[@]}" "${SETARG[@]}" --deadline-s $(( $(left) - 30 )) 2>&1 \
      | grep -E "epoch [0-9]+:|deadline|ERROR|Error|Traceback|sweep" >> "$KEEP/logs/early.log" ) &
  EARLY_PID=$!
fi

# ---- step-size selection
SUBARG=(); [ -n "$SELECT_SUBSET" ] && SUBARG=(--select-subset "$SELECT_SUBSET")
SEL_DONE=$(plan_done claim_select 2> >(tee -a "$LOG" >&2))
if [ "$SEL_DONE" = 2 ]; then
  say "refused: finished selection runs of other settings (above); the selection was not started"
  [ -n "$EARLY_PID" ] && wait "$EARLY_PID"; exit 2
fi
if [ "$SEL_DONE" != 1 ] && [ "$(left)" -gt 60 ]; then
  say "selection: starting (deadline in $(( $(left) - 30 ))s)"
  $PY -m studies cifar sweep --plan claim_select --select-epochs "$SELECT_EPOCHS" "${SUBARG[@]}" "${MARG[@]}" \
      --gpus "$GPUS" --procs-per-gpu "$SEL_PROCS" --data-root "$ROOT" "${TARG[@]}" "${SELSET[@]}" \
      --deadline-s $(( $(left) - 30 )) 2>&1 | filter 20
fi
if [ "$(plan_done claim_select)" = 1 ]; then  # adds newly selected methods, refuses a change
  $PY -m studies cifar select --root results/cifar/claim/selection 2>&1 | grep -E "selected|Error" | tee -a "$LOG"
else
  say "selection not complete yet: run this command again"
  [ -n "$EARLY_PID" ] && wait "$EARLY_PID"; tail -20 "$KEEP/logs/early.log" 2>/dev/null | tee -a "$LOG"
  exit 0
fi

# ---- the claim suite
if [ "$EPOCHS" = auto ]; then  # fixed once, before the first claim run: from the measured step times
  SCHED=results/cifar/claim/schedule.json
  TSRC=$TIMING_FILE; [ -f "$TSRC" ] || TSRC=$REPO/results/cifar/timing/timing.json  # the earlier study's
  [ -f "$SCHED" ] || $PY -m studies cifar schedule --plan claim --budget-s "${CLAIM_BUDGET_S:?EPOCHS=auto needs CLAIM_BUDGET_S}" \
      --timing "$TSRC" --gpus "$GPUS" --procs-per-gpu "$PROCS" --concurrency-gain "${GAIN:-1.0}" \
      --min-epochs 1 --out "$SCHED" 2>&1 | tail -1 | tee -a "$LOG"
  EPOCHS=$($PY -c "import json; print(json.load(open('$SCHED'))['epochs'])") || exit 2
fi
if [ "$(left)" -gt 60 ]; then
  say "claim suite: $EPOCHS epochs (deadline in $(( $(left) - 30 ))s)"
  $PY -m studies cifar sweep --plan claim --epochs "$EPOCHS" --gpus "$GPUS" --procs-per-gpu "$PROCS" "${MARG[@]}" \
      --data-root "$ROOT" "${TARG[@]}" "${SETARG[@]}" --deadline-s $(( $(left) - 30 )) 2>&1 | filter 40
fi
if [ -n "$EARLY_PID" ]; then
  say "waiting for the early claim runs"; wait "$EARLY_PID"; tail -20 "$KEEP/logs/early.log" | tee -a "$LOG"
fi
$PY -m studies cifar check --suite claim --min-epochs "$EPOCHS" 2>&1 | tee -a "$LOG"
if [ "${PIPESTATUS[0]}" = 0 ]; then  # the check's own status, not tee's
  say "claim suite complete"
else
  say "claim suite not complete yet: run this command again"
fi
