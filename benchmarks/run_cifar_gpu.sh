#!/usr/bin/env bash
# The CIFAR-10 study on ONE GPU in two phases of < 9 minutes each (book chapter experiments_cifar).
#
#   phase 1:  bash benchmarks/run_cifar_gpu.sh 1   # install nngeometry, decode data, time every method alone,
#                                                  # step-size selection (96 short runs), choose the number of
#                                                  # epochs, start the main runs; tar -> $OUT/cifar_phase1.tar.gz
#   (lead: extract that tar into the repository root so that phase 2 sees results/cifar/selection)
#   phase 2:  bash benchmarks/run_cifar_gpu.sh 2   # continue/finish the main runs (resume from checkpoints if
#                                                  # the machine is still warm); tar -> $OUT/cifar_results.tar.gz
#
# Needs: .data/cifar10_jpeg.npz (or official archives under .data/) and .whl/nngeometry-0.4-*.whl carried.
# Estimate (H100, fp32/TF32, batch 128, 50k images = 391 steps/epoch): SGD ~7 ms/step (2.7 s/epoch); on
# the CPU at tiny scale KWNG (M=5) costs ~4x an SGD step, EKFAC ~9x, KWNG M=20 ~8x, KFAC ~1.3x, so the
# 38-run main plan costs ~300 s of single-process GPU time per epoch; with 6 processes sharing the GPU
# (assumed 1.5x throughput) ~200 s per epoch. Phase 1: ~30 s setup, ~60 s timing, ~200 s selection,
# then main runs until 500 s; phase 2: main runs until 500 s. The number of epochs is computed in phase 1
# from the measured step times for a 750 s budget (clamped to [3, 15]); expect 3-5 epochs.
set -u
PHASE=${1:?usage: run_cifar_gpu.sh 1|2}
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-510}            # seconds after which this phase must be tarring
PROCS=${PROCS:-6}              # processes sharing each GPU
GPUS=${GPUS:-1}                # GPUs of the machine (one group of PROCS workers each)
MAIN_BUDGET=${MAIN_BUDGET:-750}  # single-GPU seconds the main runs may take (x GPUS for the schedule)
MAIN_IN_PHASE1=${MAIN_IN_PHASE1:-1}  # 0: phase 1 stops after selection (main runs all in phase 2)
DATA=${DATA:-.data/cifar10_jpeg.npz}
mkdir -p "$OUT"
PY=${PY:-python}
export KWNG_GIT_COMMIT=${KWNG_GIT_COMMIT:-unknown}   # no .git on the GPU machine: pass the commit in
pip install -q --no-deps --target /tmp/site .whl/nngeometry-0.4-*.whl 2>&1 | tail -1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
$PY -c "import nngeometry, torch; print('nngeometry ok; torch', torch.__version__, torch.cuda.get_device_name())"
$PY -c "from kwng.data import load_cifar; [load_cifar('cifar10', s, '$DATA') for s in ('train', 'test')]"
left() { echo $(( LIMIT - SECONDS )); }
if [ "$PHASE" = 1 ]; then
  $PY -m kwng.experiments cifar timing --steps 30 --warmup 5 2>&1 | grep -E "timing|Error"
  $PY -m kwng.experiments cifar sweep --plan select --select-steps 120 --gpus "$GPUS" --procs-per-gpu "$PROCS" \
      --data-root "$DATA" --deadline-s $(( $(left) - 60 )) 2>&1 | grep -vE "epoch 1:|UserWarning|warnings.warn" | tail -20
  $PY -m kwng.experiments cifar select 2>&1 | grep selected
  $PY -m kwng.experiments cifar schedule --budget-s $(( MAIN_BUDGET * GPUS )) 2>&1 | tail -1
  if [ "$MAIN_IN_PHASE1" = 1 ]; then
    echo "phase 1: main runs start at ${SECONDS}s"
    $PY -m kwng.experiments cifar sweep --plan main --epochs auto --gpus "$GPUS" --procs-per-gpu "$PROCS" \
        --data-root "$DATA" --deadline-s $(( $(left) - 25 )) 2>&1 | grep -E "epoch [0-9]+:|ERROR|Error" | tail -40
  fi
  TAR=cifar_phase1.tar.gz
else
  test -f results/cifar/selection/selected.json || { echo "extract the phase-1 tar first"; exit 2; }
  $PY -m kwng.experiments cifar sweep --plan main --epochs auto --gpus "$GPUS" --procs-per-gpu "$PROCS" \
      --data-root "$DATA" --deadline-s $(( $(left) - 25 )) 2>&1 | grep -E "epoch [0-9]+:|ERROR|Error" | tail -60
  $PY -m kwng.experiments cifar check; TAR=cifar_results.tar.gz
fi
tar czf "$OUT/$TAR" results/cifar
echo "phase $PHASE done in ${SECONDS}s: $OUT/$TAR ($(du -h "$OUT/$TAR" | cut -f1))"
