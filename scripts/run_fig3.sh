#!/usr/bin/env bash
# The Fig. 3 protocol (results/cifar/fig3/protocol.json) on a GPU machine, in calls of
# bounded length within one machine hold. Every run must finish inside the hold: a
# ResNet-18 checkpoint cannot come back, so runs are started only while they can finish
# (START_BY) and the records (small JSON files) come back after every call.
#
#   MODE=throughput bash scripts/run_fig3.sh  # runs/hour for k runs on one GPU (TP_GPU),
#                                              # -> $OUT/queue_throughput.json
#   MODE=start      bash scripts/run_fig3.sh  # launches a queue worker (its own process
#                                              # session: it outlives the call), then waits
#   MODE=wait       bash scripts/run_fig3.sh  # waits up to LIMIT s, then tars the records
#   MODE=timing     bash scripts/run_fig3.sh  # launches `cifar trainer-timing` of the
#                                              # protocol's methods on GPU TP_GPU (its own
#                                              # process session), then waits; the record
#                                              # comes back in the tar
#
# Knobs: GPU_IDS (the GPUs of this queue, "0"), PROCS (runs per GPU, 1), METHODS (comma
# list: the methods of this queue; queues on other GPUs take other methods), SEEDS (comma
# list: only these seeds' runs, all when empty), PLANS
# (comma list of sweep plans the queue takes in turn, "fig3"; "amortized" and
# "amortized_seeds" write under results/cifar/amortized and .../amortized_seeds, "fig3_audit"
# under results/cifar/fig3_audit, "vit" (the ViT study) under results/vit), START_BY
# (seconds from now after which no run starts), FINISH_BY (seconds from now by which a
# run must end: a run whose estimated duration, from the finished runs of its method,
# ends later is not started; EST_FACTOR, 1, multiplies that estimate of a run alone for
# runs that share a GPU), LIMIT (seconds this call may take, 560),
# DATA (.data/cifar10_jpeg.npz), TAG (the queue's name, for its log and pid),
# TIMING_METHODS (the methods MODE=timing times: the protocol's eight and the amortized
# study's four), TIMING_OUT (its record, results/cifar/fig3/timing/trainer_timing.json;
# another name for another call: an existing record is never overwritten), TIMING_ARGS (more
# arguments of `cifar trainer-timing`, e.g. "--model tiny --train-subset 256" for a CPU
# check of the script).
# KWNG_PROTOCOL_COMMIT and KWNG_GIT_COMMIT must be set (the copied tree has no .git).
# The queue loops: after each sweep it re-plans (new grid values when a best step sits
# at an inner edge, then seeds), until nothing is left or START_BY has passed.
set -u
OUT=${OUT:-/tmp/out}
MODE=${MODE:-wait}
GPU_IDS=${GPU_IDS:-0}
PROCS=${PROCS:-1}
LIMIT=${LIMIT:-560}
START_BY=${START_BY:-1200}
FINISH_BY=${FINISH_BY:-1560}
METHODS=${METHODS:-sgd,sgd_momentum,sgd_momentum_wd,adam}
PLANS=${PLANS:-fig3}
SEEDS=${SEEDS:-}
TAG=${TAG:-q0}
DATA=${DATA:-.data/cifar10_jpeg.npz}
PY=${PY:-python3}
: "${KWNG_PROTOCOL_COMMIT:?set KWNG_PROTOCOL_COMMIT (git log -1 --format=%H -- results/cifar/fig3/protocol.json results/cifar/fig3/amendments.json)}"
export KWNG_GIT_COMMIT=${KWNG_GIT_COMMIT:-unknown} KWNG_PROTOCOL_COMMIT KWNG_SCALE=full
export PYTHONUNBUFFERED=1
ROOT=$PWD
WORK=$ROOT/checkpoints/fig3_work
LOGS=$ROOT/checkpoints/logs
say() { echo "[${SECONDS}s] $*"; }

[ -f "$DATA" ] || { echo "missing $DATA (copy ../shared/data/cifar10_jpeg.npz there)"; exit 2; }
case "$MODE" in throughput|start|wait|timing) ;;
  *) echo "MODE must be throughput, start, wait or timing"; exit 2;; esac
TIMING_METHODS=${TIMING_METHODS:-sgd,sgd_momentum,sgd_momentum_wd,adam,kfac,ekfac_s10,kwng,kwng_mom,kwng_k5,kwng_k20,kwng_k100,diag_k20}
. "$ROOT/scripts/nngeometry_site.sh" && nngeometry_site "$ROOT"
# a queue or timing call with KFAC/EKFAC refuses to start without nngeometry, one with
# SOAP/Shampoo without pytorch-optimizer (the GPU machine has neither: they come as wheels
# in .whl/, which the call must carry), instead of each of its runs failing on import
NEED=$METHODS; [ "$MODE" = timing ] && NEED=$TIMING_METHODS
if [ "$MODE" = start ] || [ "$MODE" = timing ]; then
  if echo ",$NEED," | grep -qE ',e?kfac[^,]*,' && ! $PY -c "import nngeometry" 2>/dev/null; then
    echo "METHODS name KFAC/EKFAC but nngeometry cannot be imported: run 'pip download" \
         "--no-deps nngeometry==0.4 -d .whl' here and carry .whl in the call"; exit 2
  fi
  if echo ",$NEED," | grep -qE ',(soap|shampoo),' \
      && ! $PY -c "import pytorch_optimizer" 2>/dev/null; then
    echo "METHODS name SOAP/Shampoo but pytorch_optimizer cannot be imported: run 'pip" \
         "download --no-deps pytorch-optimizer==4.1.0 -d .whl' here and carry .whl"; exit 2
  fi
fi
mkdir -p "$OUT" "$LOGS" "$WORK/results/cifar"
DATA=$(readlink -f "$DATA")

if [ "$MODE" = throughput ]; then
  CUDA_VISIBLE_DEVICES=${TP_GPU:-0} $PY -m studies.bench.queue_throughput \
      --data-root "$DATA" --json "$OUT/queue_throughput.json" 2>&1 | tail -20
  exit "${PIPESTATUS[0]}"
fi

# the committed records (earlier sessions) join the work folder: finished runs are
# skipped, the early-stop rule and the selection see them, and the authors100 records
# give the run-time estimate of a method without a Fig. 3 run yet
if [ ! -f "$WORK/.seeded" ]; then
  cp -rn "$ROOT/results/cifar/fig3" "$ROOT/results/cifar/authors100" \
      $(ls -d "$ROOT"/results/cifar/amortized* "$ROOT"/results/cifar/fig3_audit 2>/dev/null) "$WORK/results/cifar/" \
    && { [ ! -d "$ROOT/results/vit" ] || cp -rn "$ROOT/results/vit" "$WORK/results/"; } \
    && touch "$WORK/.seeded"
fi
cd "$WORK"

if [ "$MODE" = start ]; then
  if [ -f "$LOGS/$TAG.pid" ] && kill -0 "$(cat "$LOGS/$TAG.pid")" 2>/dev/null; then
    say "queue $TAG already running"
  else
    END=$(( $(date +%s) + START_BY ))
    FIN=$(( $(date +%s) + FINISH_BY ))
    cat > "$LOGS/$TAG.sh" <<LOOP
cd "$WORK"
while [ \$(date +%s) -lt $END ]; do
  left=\$(( $END - \$(date +%s) )); fin=\$(( $FIN - \$(date +%s) ))
  [ \$fin -lt 300 ] && break
  started=\$(grep -c " epoch 1: " "$LOGS/$TAG.log")
  for plan in ${PLANS//,/ }; do
    left=\$(( $END - \$(date +%s) )); fin=\$(( $FIN - \$(date +%s) ))
    CUDA_VISIBLE_DEVICES=$GPU_IDS $PY -m studies cifar sweep --plan \$plan \
        --methods $METHODS --gpus $(echo "$GPU_IDS" | tr ',' '\n' | wc -l) \
        --procs-per-gpu $PROCS --data-root "$DATA" --start-by-s \$left \
        --finish-by-s \$fin --est-factor ${EST_FACTOR:-1} ${SEEDS:+--seeds $SEEDS} || true
  done
  n=\$($PY -c "import studies; studies.load_all(); from studies.cifar.plans import build_plan; s = '$SEEDS'; print(sum(1 for p in '$PLANS'.split(',') for j in build_plan(p, methods='$METHODS'.split(',')) if not s or str(j['seed']) in s.split(',')))")
  echo "queue $TAG: \$n run(s) left"
  [ "\$n" = 0 ] && break
  # a pass that began no run (every run left would end after FINISH_BY) ends the
  # queue: its process exits, so a later queue may wait on it
  [ "\$(grep -c " epoch 1: " "$LOGS/$TAG.log")" = "\$started" ] && break
  sleep 5
done
LOOP
    setsid nohup bash "$LOGS/$TAG.sh" > "$LOGS/$TAG.log" 2>&1 < /dev/null &
    echo $! > "$LOGS/$TAG.pid"
    say "queue $TAG started on GPU(s) $GPU_IDS with $PROCS run(s) per GPU: $PLANS: $METHODS"
  fi
fi

if [ "$MODE" = timing ]; then
  # one call times every method alone on one GPU: the clock of the time figure
  # (studies.fig3.clocks); an existing record makes the command refuse
  if [ -f "$LOGS/timing.pid" ] && kill -0 "$(cat "$LOGS/timing.pid")" 2>/dev/null; then
    say "trainer timing already running"
  else
    setsid nohup env CUDA_VISIBLE_DEVICES="${TP_GPU:-0}" $PY -m studies cifar \
        trainer-timing --methods "$TIMING_METHODS" --precisions bf16 --epochs 2 \
        --data-root "$DATA" --out "${TIMING_OUT:-results/cifar/fig3/timing/trainer_timing.json}" \
        ${TIMING_ARGS:-} > "$LOGS/qtiming.log" 2>&1 < /dev/null &
    echo $! > "$LOGS/timing.pid"
    say "trainer timing started on GPU ${TP_GPU:-0}: $TIMING_METHODS"
  fi
fi

# ---- wait (MODE=start and MODE=timing continue here): until LIMIT, or until every queue has ended
while [ $SECONDS -lt $((LIMIT - 30)) ]; do
  alive=0
  for f in "$LOGS"/*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
  sleep 10
done
grep -hE "Error|Traceback|failed|early stop|left" "$LOGS"/*.log 2>/dev/null | tail -12
tar czf "$OUT/fig3.tar.gz" -C "$WORK" results/cifar/fig3 \
    $(cd "$WORK" && ls -d results/cifar/amortized* results/cifar/fig3_audit results/vit 2>/dev/null) && say "tarred $(du -h "$OUT/fig3.tar.gz" | cut -f1)"
cp "$LOGS"/*.log "$OUT/" 2>/dev/null  # every queue's log (any TAG) and the timing's
$PY -m studies cifar check --suite fig3 | tail -20
exit 0
