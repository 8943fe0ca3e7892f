#!/usr/bin/env bash
# Weak scaling of KWNG data-parallel against SGD under DDP (studies.bench.ddp_scaling),
# one torchrun job per world size, merged into ONE file: $OUT/ddp_scaling.json.
#
#   OUT=/some/dir bash scripts/run_ddp_scaling.sh        # 4 GPUs: W = 1, 2, 4
#
# Environment (defaults in brackets):
#   OUT           where the merged file and the per-W parts go [$PWD/ddp_scaling_out];
#                 an existing $OUT/ddp_scaling.json is never overwritten (the script stops)
#   WORLD_SIZES   the world sizes, W = 1 first (the efficiency's baseline) ["1 2 4"]
#   DEVICE        cuda | cpu [cuda]; on cuda, W uses CUDA_VISIBLE_DEVICES=0..W-1
#   MODEL         resnet18 | tiny [resnet18];  BATCH per rank [128];  NUM_BASIS [5]
#   STEPS, WARMUP timed steps and eager warm-up steps per row [20, 3] (DDP: 11)
#   PER_W_TIMEOUT seconds one world size may take before it is killed [150]: the
#                 three world sizes fit in 8 minutes
#   EXTRA         more arguments for every job (e.g. "--precisions bf16")
#   KWNG_GIT_COMMIT  recorded as the commit when the tree has no .git
# A world size that fails or times out is reported; the merge takes the parts that exist
# (a part keeps every row measured before a crash) and the script exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/ddp_scaling_out}
WORLD_SIZES=${WORLD_SIZES:-"1 2 4"}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-resnet18}
BATCH=${BATCH:-128}
NUM_BASIS=${NUM_BASIS:-5}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-3}
PER_W_TIMEOUT=${PER_W_TIMEOUT:-150}
EXTRA=${EXTRA:-}
PY=${PYTHON:-python}
FINAL="$OUT/ddp_scaling.json"
if [ -e "$FINAL" ]; then
  echo "$FINAL exists: choose another OUT (results are never overwritten)" >&2
  exit 2
fi
PARTS_DIR="$OUT/parts.$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$PARTS_DIR"
export KWNG_DDP_DRIVER="OUT=$OUT WORLD_SIZES='$WORLD_SIZES' DEVICE=$DEVICE MODEL=$MODEL \
BATCH=$BATCH NUM_BASIS=$NUM_BASIS STEPS=$STEPS WARMUP=$WARMUP EXTRA='$EXTRA' \
bash scripts/run_ddp_scaling.sh"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
parts=()
status=0
t_start=$(date +%s)
for W in $WORLD_SIZES; do
  part="$PARTS_DIR/part_w$W.json"
  if [ "$DEVICE" = cuda ]; then
    export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((W - 1)))
  fi
  echo "== W=$W (${CUDA_VISIBLE_DEVICES:-cpu}) -> $part"
  # shellcheck disable=SC2086
  timeout --kill-after=10 "$PER_W_TIMEOUT" "$PY" -m torch.distributed.run \
    --standalone --nproc-per-node="$W" -m studies.bench.ddp_scaling \
    --out "$part" --device "$DEVICE" --model "$MODEL" --batch "$BATCH" \
    --num-basis "$NUM_BASIS" --steps "$STEPS" --warmup "$WARMUP" $EXTRA
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "!! W=$W failed or timed out (exit $rc); its part keeps the rows measured" >&2
    status=1
  fi
  [ -e "$part" ] && parts+=("$part")
done
unset CUDA_VISIBLE_DEVICES
if [ ${#parts[@]} -eq 0 ]; then
  echo "no world size produced a result" >&2
  exit 1
fi
"$PY" -m studies.bench.ddp_record "${parts[@]}" --out "$FINAL" || exit 1
echo "wrote $FINAL in $(( $(date +%s) - t_start )) s (parts in $PARTS_DIR)"
exit $status
