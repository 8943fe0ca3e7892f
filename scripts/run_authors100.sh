#!/usr/bin/env bash
# The CIFAR-10 study at the authors' horizon (plan authors100) on a GPU machine.
# Checks every prerequisite before starting anything; moves nothing. The sweep runs in
# checkpoints/authors100_work/ (ignored by git), so its results/ and checkpoints/ live
# outside the synced working tree: the device tool replaces the tree's non-ignored files
# at every call, which deleted the records of finished runs from results/ between calls
# when this script wrote there (a session had to merge them back from the
# tarballs of each call).
#
#   MODE=timing  bash scripts/run_authors100.sh   # one GPU: eager vs captured trainer
#                                                   # (cifar trainer-timing), ~5 min
#   MODE=start   bash scripts/run_authors100.sh   # launches the sweep in the background
#                                                   # (its own process session: it outlives
#                                                   # the call), then waits like MODE=wait
#   MODE=wait    bash scripts/run_authors100.sh   # waits up to LIMIT s, then tars the
#                                                   # records to $OUT/authors100.tar.gz
#
# The sweep runs on while the machine is held: call MODE=wait again within the machine's
# idle window until it prints "authors100 complete". Extract the tarball in the
# repository root. Knobs: GPUS (4), PROCS (workers per GPU, 4: every run at once), LIMIT (seconds a call
# may take, 560), DATA (the JPEG npz, .data/cifar10_jpeg.npz), TIERS (for the check, 1).
set -u
OUT=${OUT:-/tmp/out}
MODE=${MODE:-wait}
GPUS=${GPUS:-4}
PROCS=${PROCS:-4}
LIMIT=${LIMIT:-560}
TIERS=${TIERS:-1}
DATA=${DATA:-.data/cifar10_jpeg.npz}
PY=${PY:-python3}
export KWNG_GIT_COMMIT=${KWNG_GIT_COMMIT:-unknown}   # the copy may have no .git
export PYTHONUNBUFFERED=1
ROOT=$PWD
WORK=$ROOT/checkpoints/authors100_work
LOGS=$ROOT/checkpoints/logs
say() { echo "[${SECONDS}s] $*"; }

# ---- prerequisites, before anything is written
[ -f "$DATA" ] || { echo "missing $DATA (copy ../shared/data/cifar10_jpeg.npz there)"; exit 2; }
case "$MODE" in timing|start|wait) ;; *) echo "MODE must be timing, start or wait"; exit 2;; esac
. "$ROOT/scripts/nngeometry_site.sh" && nngeometry_site "$ROOT"
$PY -c "import nngeometry, torch; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.device_count(), 'GPU(s)')" || exit 2
mkdir -p "$OUT" "$LOGS" "$WORK"
DATA=$(readlink -f "$DATA")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
$PY -c "from studies.cifar.data import load_cifar; [load_cifar('cifar10', s, '$DATA') for s in ('train', 'test')]" || exit 2

tar_results() {  # extract in the repository root: results/cifar/authors100/...
  tar czf "$OUT/authors100.tar.gz" -C "$WORK" results/cifar/authors100 2>/dev/null
  cp "$LOGS"/*.log "$OUT/" 2>/dev/null
  say "tarred $(du -h "$OUT/authors100.tar.gz" 2>/dev/null | cut -f1)"
}
progress() {
  $PY - <<'PYEOF'
import json, pathlib
for p in sorted(pathlib.Path("results/cifar/authors100").glob("*/cifar10/*/*/seed*/metrics.json")) + \
         sorted(pathlib.Path("results/cifar/authors100").glob("fp32/*/cifar10/*/*/seed*/metrics.json")):
    r = json.loads(p.read_text()); e = r["epochs"]
    if e:
        print(f"{str(p.parent)[26:]:45s} {len(e):3d}/{r['config']['epochs']} acc {e[-1]['test_acc']:.3f} "
              f"t {e[-1]['time_train']:.0f}s {'complete' if r['complete'] else ''}")
PYEOF
}

if [ "$MODE" = timing ]; then
  cd "$ROOT" && CUDA_VISIBLE_DEVICES=0 $PY -m studies cifar trainer-timing \
      --methods sgd,adam,kfac,kwng,diag_Ttilde --precisions bf16,fp32 --data-root "$DATA" \
      --out "$OUT/trainer_timing.json" 2>&1 | grep -E "trainer timing|loss match|Error|Traceback|error" 
  exit "${PIPESTATUS[0]}"
fi

cd "$WORK"   # the sweep's relative results/ and checkpoints/ land here
if [ "$MODE" = start ]; then
  if [ -f "$LOGS/sweep.pid" ] && kill -0 "$(cat "$LOGS/sweep.pid")" 2>/dev/null; then
    say "sweep already running"
  else
    # the GPU balance from the measured trainer (bf16, captured where it captures)
    mkdir -p checkpoints
    ROOT="$ROOT" $PY - <<'PYEOF' || exit 2
import json
import os
d = json.load(open(os.path.join(os.environ["ROOT"], "results/cifar/authors100/timing/trainer_timing.json")))
m = {}
for r in d["rows"]:
    if r["precision"] == "bf16" and (r["mode"] == "captured" or not r["asked_capture"]):
        m[r["method"]] = {"sec_per_step": r["steady_ms_per_step"] / 1e3, "batch_size": 128}
m["kwng_basis20"] = {"sec_per_step": 3.8 * m["kwng"]["sec_per_step"], "batch_size": 128}
json.dump({"methods": m}, open("checkpoints/authors100_timing.json", "w"), indent=1)
print({k: round(v["sec_per_step"] * 1e3, 2) for k, v in m.items()}, "ms per step")
PYEOF
    setsid nohup $PY -m studies cifar sweep --plan authors100 --gpus "$GPUS" \
        --procs-per-gpu "$PROCS" --data-root "$DATA" --timing checkpoints/authors100_timing.json \
        > "$LOGS/sweep.log" 2>&1 < /dev/null &
    echo $! > "$LOGS/sweep.pid"
    say "sweep started (pid $(cat "$LOGS/sweep.pid"))"
  fi
fi

# ---- wait (MODE=start continues here)
while [ $SECONDS -lt $((LIMIT - 25)) ]; do
  kill -0 "$(cat "$LOGS/sweep.pid" 2>/dev/null)" 2>/dev/null || break
  sleep 10
done
progress
grep -E "Error|Traceback|failed" "$LOGS/sweep.log" | tail -5
tar_results
if $PY -m studies cifar check --suite authors100 --tiers "$TIERS"; then
  say "authors100 complete"
else
  say "authors100 not complete yet: call MODE=wait again"
fi
