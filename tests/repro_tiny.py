"""The CIFAR trainer's per-epoch numbers on a fixed tiny problem, kept as a fixture
(``tests/data/repro_tiny.json``) so that a change to the trainer's structure can show it
trains exactly as before: 2 epochs of the tiny CNN on 200 images of the committed
sample, a 50-image validation split, the authors' schedule and ε, CPU.

Regenerate (only when a change of the numbers is intended, and say why in the commit)::

    PYTHONPATH=. python tests/repro_tiny.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "data" / "repro_tiny.json"
#: (method, conditioning, step) of every fixture run
CASES = (("sgd", "ill", 0.1), ("sgd_momentum_wd", "well", 0.05), ("adam", "ill", 1e-3),
         ("kwng", "ill", 1.0), ("kwng", "well", 0.5), ("diag_Ttilde", "ill", 1.0),
         ("kfac", "ill", 0.1))
#: per-epoch fields that depend on timing, not on what was trained
TIMING = ("time_train", "time_eval", "time_unix")


def tiny_rows(method: str, conditioning: str, lr: float, root: str) -> list[dict]:
    """Train one fixture case under ``root`` and return its per-epoch rows without the
    timing fields."""
    from kwng.experiments.cifar import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order on every machine
    cfg = {"source": "sample", "model": "tiny", "batch_size": 50, "epochs": 2,
           "lr": lr, "device": "cpu", "method": method, "conditioning": conditioning,
           "train_subset": 200, "val_size": 50, "eval_test": True,
           "schedule": "authors", "out": str(Path(root) / "res"),
           "checkpoint_dir": str(Path(root) / "ck")}
    try:
        rec = train.run(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rec["epochs"]]


def key(case: tuple) -> str:
    return "/".join(str(c) for c in case)


def main() -> int:
    out = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out[key(case)] = tiny_rows(*case, tmp)
        print(key(case), out[key(case)][-1]["test_acc"])
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print("wrote", FIXTURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
