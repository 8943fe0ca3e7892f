"""How many CIFAR runs an hour one GPU gives when it trains ``k`` runs at once.

One ResNet-18 at batch 128 keeps only part of an H100 busy (a captured bf16 SGD step is
a few ms), so a queue of many short runs may go faster with several runs on one GPU.
This benchmark starts ``k`` copies of the study's trainer (``python -m studies
cifar``, SGD, bf16, channels_last, CUDA-graph capture) on one GPU, as separate
processes, and, where the machine has it, under CUDA MPS (the multi-process service,
which lets the kernels of several processes run side by side). Each run trains
``--epochs`` epochs on ``--subset`` images. The throughput is measured only while all
``k`` runs train at once (from the per-epoch Unix times of their records: a run still
starting or already finished would flatter the others), and reported as 100-epoch runs
per hour of the Fig. 3 protocol (45,000 training images, batch 128) and as the ratio to
``k = 1``, printed side by side. The command::

    python -m studies.bench.queue_throughput \\
        --data-root DATA --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from studies.kit.provenance import atomic_write_json, make_provenance

__all__ = ["main", "measure"]

#: steps of one 100-epoch run of the Fig. 3 protocol (45,000 images, batch 128)
PROTOCOL_STEPS = 100 * 352


def _start_mps(tmp: Path) -> dict | None:
    """Start an MPS control daemon with its pipes in ``tmp``; the environment its
    clients need, or ``None`` when the machine has no MPS."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return None
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp / "mps_pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(tmp / "mps_log")}
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    r = subprocess.run([exe, "-d"], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=30)
    return env if r.returncode == 0 else None


def _stop_mps(env: dict) -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True,
                   env={**os.environ, **env}, timeout=30, check=False)


def _one_batch(k: int, args: argparse.Namespace, tmp: Path, extra_env: dict) -> dict:
    """``k`` runs at once; their aggregate throughput while all of them train
    (:func:`_overlap`)."""
    procs, t0 = [], time.perf_counter()
    for i in range(k):
        cmd = [sys.executable, "-m", "studies", "cifar", "--method", "sgd",
               "--conditioning", "ill", "--lr", "0.1", "--schedule", "constant",
               "--epochs", str(args.epochs), "--train-subset", str(args.subset),
               "--capture", "--precision", "bf16", "--channels-last", "--no-progress",
               "--model", "resnet18", "--seed", str(i),
               "--out", str(tmp / f"k{k}" / f"r{i}"),
               "--checkpoint-dir", str(tmp / "ck" / f"k{k}" / f"r{i}")]
        if args.data_root:
            cmd += ["--data-root", args.data_root]
        env = {**os.environ, **extra_env, "KWNG_SCALE": "full"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errors = [p.communicate()[1][-400:] for p in procs if p.wait() != 0]
    if errors:
        raise RuntimeError(f"{len(errors)} of {k} runs failed: {errors[0]}")
    rows = [json.loads(p.read_text())["epochs"]
            for p in sorted((tmp / f"k{k}").glob("r*/**/metrics.json"))]
    return {"k": k, **_overlap(rows), "wall_s": time.perf_counter() - t0}


def _overlap(runs: list[list[dict]]) -> dict:
    """Aggregate throughput while every run trains at once: the window from the
    latest end of a first epoch to the earliest end of a last epoch (per-epoch Unix
    times of the records); each run's steps in it by linear interpolation between its
    epoch ends. Evaluation time inside the window counts, as it does in a queue."""
    start = max(r[0]["time_unix"] for r in runs)
    end = min(r[-1]["time_unix"] for r in runs)
    if end <= start:
        raise RuntimeError("the runs never trained at the same time: raise --epochs")
    steps = 0.0
    for r in runs:
        t = [e["time_unix"] for e in r]
        n = [e["steps"] for e in r]
        steps += _at(t, n, end) - _at(t, n, start)
    per_step = 1e3 * (end - start) / steps
    return {"window_s": end - start, "ms_per_step": per_step,
            "runs_per_hour": 3600e3 / (per_step * PROTOCOL_STEPS)}


def _at(t: list[float], n: list[int], x: float) -> float:
    """Steps done at time ``x`` (linear between epoch ends)."""
    for (t0, n0), (t1, n1) in zip(zip(t, n), zip(t[1:], n[1:])):
        if t0 <= x <= t1:
            return n0 + (n1 - n0) * (x - t0) / (t1 - t0)
    return float(n[-1] if x >= t[-1] else n[0])


def measure(args: argparse.Namespace) -> dict:
    """Every ``k`` of ``args.ks`` as separate processes, then under MPS when
    available."""
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="queue_tp_"))
    for k in args.ks:
        rows.append({"mode": "processes", **_one_batch(k, args, tmp / "p", {})})
        print(f"processes k={k}: {rows[-1]['runs_per_hour']:.1f} runs/h", flush=True)
    mps = _start_mps(tmp) if args.mps else None
    if mps is not None:
        try:
            for k in args.mps_ks:
                rows.append({"mode": "mps", **_one_batch(k, args, tmp / "m", mps)})
                print(f"mps k={k}: {rows[-1]['runs_per_hour']:.1f} runs/h", flush=True)
        finally:
            _stop_mps(mps)
    base = rows[0]["runs_per_hour"]
    for r in rows:
        r["ratio_to_k1"] = r["runs_per_hour"] / base
    best = max(rows, key=lambda r: r["runs_per_hour"])
    return {"rows": rows, "mps_available": mps is not None,
            "streams": "not measured: one process replaying k captured steps on k "
                       "CUDA streams needs a multi-run trainer the package does not "
                       "have",
            "best": {"mode": best["mode"], "k": best["k"]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", default=None)
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--mps-ks", default="4,8")
    p.add_argument("--no-mps", dest="mps", action="store_false")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--subset", type=int, default=12_800)
    p.add_argument("--json", default=None, help="write the record here (refused if "
                   "the file exists)")
    a = p.parse_args(argv)
    try:
        a.ks = [int(x) for x in a.ks.split(",")]
        a.mps_ks = [int(x) for x in a.mps_ks.split(",")]
    except ValueError:
        p.error("--ks and --mps-ks take comma lists of integers")
    if min(a.ks + a.mps_ks) < 1 or a.epochs < 2 or a.subset < 128:
        p.error("--ks/--mps-ks must be >= 1, --epochs >= 2, --subset >= 128")
    if a.json and Path(a.json).exists():
        p.error(f"--json {a.json} exists: results are never overwritten")
    res = measure(a)
    print(f"{'mode':10s} {'k':>3s} {'runs/h':>8s} {'x k=1':>6s} {'ms/step':>8s} window")
    for r in res["rows"]:
        print(f"{r['mode']:10s} {r['k']:3d} {r['runs_per_hour']:8.1f} "
              f"{r['ratio_to_k1']:6.2f} {r['ms_per_step']:8.2f} {r['window_s']:.0f} s")
    if a.json:
        res["provenance"] = make_provenance(vars(a), device="cuda")
        atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
