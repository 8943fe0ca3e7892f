#!/usr/bin/env bash
# Full-scale synthetic experiments of the kwng book (Figs. 1, 2, 5, 6) on one CUDA GPU.
# Usage (repository root):  bash scripts/run_synthetic_full.sh
# Each sweep resumes where it stopped: rerun the same command after an interruption.
# Results: results/{relerr,bandwidth,flow}/ (CSV + provenance.json).
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
PY="${PYTHON:-python3}"
python_version=$("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no cuda")')
echo "torch/device: $python_version"
"$PY" - <<'PYEOF'
# one estimate at d=10, N=5000, M=707 (float64) for the record
import time, torch, kwng
m = kwng.NormalModel(10); g = torch.Generator().manual_seed(0)
th = m.params_near_reference(g); gr = 0.1 ** 0.5 * torch.randn(m.num_params, generator=g, dtype=torch.float64)
Z = m.sample_latent(5000, g).cuda()
for rep in range(3):
    torch.cuda.synchronize(); t = time.perf_counter()
    kwng.kwng_gradient(lambda x: m.sample(x, Z), th.cuda(), gr.cuda(), num_basis=707, eps=1e-5,
                       kernel=kwng.GaussianKernel(1.0), bandwidth="mean_sq", sigma0=0.5, generator=g)
    torch.cuda.synchronize(); print(f"one KWNG estimate d=10 N=5000 M=707 float64 on GPU: {time.perf_counter() - t:.3f} s")
PYEOF
for name in flow relerr bandwidth; do
  SECONDS=0
  mem=(); [ "$name" = flow ] || mem=(--mem-gb "${KWNG_MEM_GB:-8}")  # sweeps only
  "$PY" -m studies "$name" --scale full --device cuda "${mem[@]}" --no-progress
  echo "SWEEP $name wall time: ${SECONDS} s"
done
