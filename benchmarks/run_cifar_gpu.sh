#!/usr/bin/env bash
# The CIFAR-10 claim suite (book chapter experiments_cifar, issue 10) on one multi-GPU machine, in
# calls of at most LIMIT seconds each. Run the SAME command again until it prints "claim suite
# complete"; every call resumes where the previous one stopped (checkpoints and results persist in
# the ignored folder checkpoints/ on the machine's disk between calls):
#
#   KWNG_GIT_COMMIT=$(git rev-parse HEAD) GPUS=4 LIMIT=560 EPOCHS=30 bash benchmarks/run_cifar_gpu.sh
#
# Each call: (1) install nngeometry from .whl/ and copy .data/cifar10_jpeg.npz to checkpoints/data
# (decoded once, cached there); (2) first call only: `cifar timing` of the claim methods alone on
# GPU 0 (TIMING=0 skips it); (3) step-size selection (plan claim_select: 7 methods x 2
# conditionings x 6 step sizes, SELECT_EPOCHS epochs each, scored on 5,000 held-out training images)
# until it is complete, then `cifar select`; (4) the claim suite (plan claim, EPOCHS epochs) with the
# selected step sizes; (5) `cifar check --suite claim`; (6) results/cifar/claim and the log tarred to
# $OUT/cifar_claim.tar.gz (extract it in the repository root: it holds results/cifar/claim/...).
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
# DATA (the JPEG npz), PY, SET (run-setting overrides for every run, e.g. for a CPU smoke test:
# SET="model=tiny batch_size=50 train_subset=150 device=cpu" SEL_SET="val_size=100" GPUS=0
# DATA=kwng/data_sample/cifar10_sample.npz TIMING_MODEL=tiny TIMING_STEPS=3).
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
SETARG=(); for kv in ${SET:-}; do SETARG+=(--set "$kv"); done
METHODS=${METHODS:-}             # comma list: run only these methods' part of both plans (a suite in parts)
EARLY_METHODS=${EARLY_METHODS:-} # comma list: claim runs of these start beside the selection
EARLY_PROCS=${EARLY_PROCS:-2}
SELSET=("${SETARG[@]}"); for kv in ${SEL_SET:-}; do SELSET+=(--set "$kv"); done
PY=${PY:-python}
KEEP=checkpoints/keep            # persists between calls (ignored by git, not replaced by the sync)
mkdir -p "$OUT" "$KEEP/data" checkpoints/logs
LOG="$OUT/cifar_claim_log.txt"
export KWNG_GIT_COMMIT=${KWNG_GIT_COMMIT:-unknown}   # pass the commit in: the copy may have no .git
export PYTHONUNBUFFERED=1
left() { echo $(( LIMIT - SECONDS )); }
say() { echo "[${SECONDS}s] $*" | tee -a "$LOG"; }

# ---- setup
if ls .whl/nngeometry-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/nngeometry-*.whl 2>&1 | tail -1
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ "$GPUS" -gt 0 ] && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$LOG"
# results/cifar/claim is a link into $KEEP, so every write lands on the kept disk at once (a killed
# call loses nothing that was written). A real folder there (first call, or results extracted into
# the tree) moves into $KEEP if $KEEP has none, else aside to $KEEP/claim.from_tree.<time>.
mkdir -p results/cifar
if [ -d results/cifar/claim ] && [ ! -L results/cifar/claim ]; then
  if [ -d "$KEEP/claim" ]; then mv results/cifar/claim "$KEEP/claim.from_tree.$(date +%s)"
  else mv results/cifar/claim "$KEEP/claim"; fi
fi
mkdir -p "$KEEP/claim"
rm -f results/cifar/claim && ln -s "$PWD/$KEEP/claim" results/cifar/claim
[ -f "$KEEP/data/cifar10_jpeg.npz" ] || cp "$DATA" "$KEEP/data/cifar10_jpeg.npz" || exit 2
ROOT="$KEEP/data/cifar10_jpeg.npz"
$PY -c "import nngeometry, torch; print('nngeometry ok; torch', torch.__version__)" || exit 2
$PY -c "from kwng.data import load_cifar; [load_cifar('cifar10', s, '$ROOT') for s in ('train', 'test')]" || exit 2
TIMING_METHODS=${TIMING_METHODS:-${METHODS:-claim}}  # every method of the suite, in one timing run
if [ -n "$EARLY_METHODS" ]; then  # the other methods: the selection and the main claim sweep
  ALL=${METHODS:-$($PY -c "from kwng.experiments import cifar
print(','.join(dict.fromkeys(j['method'] for j in cifar.build_plan('claim', epochs=1))))")}
  METHODS=$($PY -c "e = set('$EARLY_METHODS'.split(','))
print(','.join(m for m in '$ALL'.split(',') if m not in e))")
  say "early claim methods: $EARLY_METHODS; the others: $METHODS"
fi
MARG=(); [ -n "$METHODS" ] && MARG=(--methods "$METHODS")
say "setup done"

persist() {  # the results (through the link) to $OUT, whatever happened before
  tar czhf "$OUT/cifar_claim.tar.gz" results/cifar/claim 2>/dev/null
  say "tarred: $OUT/cifar_claim.tar.gz ($(du -h "$OUT/cifar_claim.tar.gz" 2>/dev/null | cut -f1))"
}
trap persist EXIT
plan_done() {  # prints 1 if every run of plan $1 is complete
  $PY -c "
from kwng.experiments import cifar
p = cifar.build_plan('$1', epochs=1, select_epochs=$SELECT_EPOCHS, data_root='$ROOT',
                     select_subset=${SELECT_SUBSET:-None}, select_val=5000,
                     methods='$METHODS'.split(',') if '$METHODS' else None)
print(int(all(cifar._is_complete(j) for j in p)))"
}
filter() { grep -E "epoch [0-9]+:|deadline|ERROR|Error|Traceback|sweep" | tee -a "$LOG" | tail -${1:-30}; }

# ---- timing of each method alone (first call only)
TIMING_FILE=results/cifar/claim/timing/timing.json
if [ "$TIMING" = 1 ] && [ ! -f "$TIMING_FILE" ]; then
  CUDA_VISIBLE_DEVICES=0 $PY -m kwng.experiments cifar timing --methods "$TIMING_METHODS" --steps "${TIMING_STEPS:-100}" \
      --warmup 10 --out "$TIMING_FILE" ${TIMING_MODEL:+--model "$TIMING_MODEL"} 2>&1 | grep -E "timing|Error" | tee -a "$LOG"
fi
TARG=(); [ -f "$TIMING_FILE" ] && TARG=(--timing "$TIMING_FILE")

# ---- claim runs of methods selected earlier, beside the selection (to the same deadline)
EARLY_PID=
if [ -n "$EARLY_METHODS" ] && [ "$(left)" -gt 60 ]; then
  say "early claim runs ($EARLY_METHODS): starting (deadline in $(( $(left) - 30 ))s)"
  ( $PY -m kwng.experiments cifar sweep --plan claim --epochs "$EPOCHS" --gpus "$GPUS" --procs-per-gpu "$EARLY_PROCS" \
      --methods "$EARLY_METHODS" --data-root "$ROOT" "${TARG[@]}" "${SETARG[@]}" --deadline-s $(( $(left) - 30 )) 2>&1 \
      | grep -E "epoch [0-9]+:|deadline|ERROR|Error|Traceback|sweep" >> checkpoints/logs/early.log ) &
  EARLY_PID=$!
fi

# ---- step-size selection
SUBARG=(); [ -n "$SELECT_SUBSET" ] && SUBARG=(--select-subset "$SELECT_SUBSET")
if [ "$(plan_done claim_select)" != 1 ] && [ "$(left)" -gt 60 ]; then
  say "selection: starting (deadline in $(( $(left) - 30 ))s)"
  $PY -m kwng.experiments cifar sweep --plan claim_select --select-epochs "$SELECT_EPOCHS" "${SUBARG[@]}" "${MARG[@]}" \
      --gpus "$GPUS" --procs-per-gpu "$SEL_PROCS" --data-root "$ROOT" "${TARG[@]}" "${SELSET[@]}" \
      --deadline-s $(( $(left) - 30 )) 2>&1 | filter 20
fi
if [ "$(plan_done claim_select)" = 1 ]; then  # adds newly selected methods, refuses a change
  $PY -m kwng.experiments cifar select --root results/cifar/claim/selection 2>&1 | grep -E "selected|Error" | tee -a "$LOG"
else
  say "selection not complete yet: run this command again"
  [ -n "$EARLY_PID" ] && wait "$EARLY_PID"; tail -20 checkpoints/logs/early.log 2>/dev/null | tee -a "$LOG"
  exit 0
fi

# ---- the claim suite
if [ "$EPOCHS" = auto ]; then  # fixed once, before the first claim run: from the measured step times
  SCHED=results/cifar/claim/schedule.json
  TSRC=$TIMING_FILE; [ -f "$TSRC" ] || TSRC=results/cifar/timing/timing.json  # the earlier study's
  [ -f "$SCHED" ] || $PY -m kwng.experiments cifar schedule --plan claim --budget-s "${CLAIM_BUDGET_S:?EPOCHS=auto needs CLAIM_BUDGET_S}" \
      --timing "$TSRC" --gpus "$GPUS" --procs-per-gpu "$PROCS" --concurrency-gain "${GAIN:-1.0}" \
      --min-epochs 1 --out "$SCHED" 2>&1 | tail -1 | tee -a "$LOG"
  EPOCHS=$($PY -c "import json; print(json.load(open('$SCHED'))['epochs'])") || exit 2
fi
if [ "$(left)" -gt 60 ]; then
  say "claim suite: $EPOCHS epochs (deadline in $(( $(left) - 30 ))s)"
  $PY -m kwng.experiments cifar sweep --plan claim --epochs "$EPOCHS" --gpus "$GPUS" --procs-per-gpu "$PROCS" "${MARG[@]}" \
      --data-root "$ROOT" "${TARG[@]}" "${SETARG[@]}" --deadline-s $(( $(left) - 30 )) 2>&1 | filter 40
fi
if [ -n "$EARLY_PID" ]; then
  say "waiting for the early claim runs"; wait "$EARLY_PID"; tail -20 checkpoints/logs/early.log | tee -a "$LOG"
fi
$PY -m kwng.experiments cifar check --suite claim --min-epochs "$EPOCHS" 2>&1 | tee -a "$LOG"
if [ "${PIPESTATUS[0]}" = 0 ]; then  # the check's own status, not tee's
  say "claim suite complete"
else
  say "claim suite not complete yet: run this command again"
fi
