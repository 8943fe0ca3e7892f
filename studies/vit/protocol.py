"""The ViT study's protocol: the Fig. 3 protocol (:mod:`studies.fig3.protocol`) on the
Vision Transformer of :mod:`studies.cifar.vit`, at a horizon of 50 epochs.

The protocol is a committed file (:data:`PROTOCOL_FILE`, ``results/vit/protocol.json``)
in the Fig. 3 protocol's format, so that the Fig. 3 study's code reads it unchanged:
the step selection and the extension rule (:func:`studies.fig3.protocol.grid_state`),
the early-stop rule, the queue (:func:`studies.fig3.plan.fig3_plan`, plan ``vit``),
every record's check (:func:`studies.fig3.protocol.check_fig3`, ``cifar check --suite
vit``) and the verdict rule. What differs from Fig. 3 is written in the file itself:
the network (``model="vit"``), the horizon (50 epochs, step ×0.1 after epoch 25: the
``half`` schedule), the methods (:data:`METHODS_VIT`) and the first window of each
method, which is centred on the step the ResNet-18's Fig. 3 selection chose for that
method, or for the method named in :data:`WINDOW_OF`, in the same conditioning
(:func:`vit_windows`). :func:`protocol_spec` builds the file from the committed Fig. 3
records; ``python -m studies vit-protocol --out results/vit/protocol.json`` writes it
once (an existing file is never overwritten), and it is committed before the study's
first run.

Why 50 epochs: on one H200 (``results/vit/step_cost_vit.json``, bf16, batch 128) a
captured SGD step of the ViT takes 3.2 ms and a captured exact KWNG step 10.9 ms, so an
epoch of 352 steps takes about 1.1 s and 3.8 s before its evaluation, and 50 epochs of
the slowest method about 200 s, the length of a Fig. 3 run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from studies.cifar.hooks import register_check, register_plan
from studies.fig3.plan import fig3_check, fig3_plan
from studies.fig3.protocol import (
    FIG3,
    grid_state,
    load_protocol,
    protocol_commit,
    window_for,
)
from studies.kit import paths
from studies.kit.provenance import atomic_write_json

__all__ = ["VIT", "PROTOCOL_FILE", "METHODS_VIT", "WINDOW_OF", "EPOCHS",
           "vit_windows", "protocol_spec", "load_vit_protocol", "vit_plan", "vit_check"]

#: the study's records, ``results/vit`` of the checkout
#:
#: :meta hide-value:
VIT = paths.RESULTS / "vit"
#: the protocol, committed before the study's first run
#:
#: :meta hide-value:
PROTOCOL_FILE = VIT / "protocol.json"
#: the study's horizon in epochs
EPOCHS = 50
#: the study's methods, each in both conditionings and cheapest first (SGD +
#: momentum, Adam, AdamW as the transformer default, KFAC with its factors on the
#: ViT's linear layers by :mod:`studies.cifar.kfac_tokens`, the amortized KWNG step
#: that the seed study recommends with ``refresh_every=20``, and exact KWNG)
METHODS_VIT = ("sgd_momentum", "adam", "adamw", "kfac", "kwng_k20", "kwng")
#: a method without a Fig. 3 selection of its own takes its first window from this one
WINDOW_OF = {"adamw": "adam", "kwng_k20": "kwng"}


def vit_windows(methods: tuple[str, ...], fig3_p: dict,
                fig3_root: str | os.PathLike = FIG3) -> tuple[dict, dict]:
    """``(windows, sources)``: per ``"<conditioning>/<method>"`` the first three grid
    steps of the method (its Fig. 3 selected step in that conditioning, or that of
    :data:`WINDOW_OF`'s method, with its two grid neighbours:
    :func:`~studies.fig3.protocol.window_for` of a tenth of it) and where that step
    came from. Raises ``ValueError`` when a Fig. 3 selection it needs is not final."""
    state = grid_state(fig3_p, fig3_root)
    windows, sources = {}, {}
    for cond in fig3_p["conditionings"]:
        for m in methods:
            src = WINDOW_OF.get(m, m)
            st = state.get(f"{cond}/{src}")
            if not st or not st["final"]:
                raise ValueError(f"the Fig. 3 selection of {cond}/{src} (the window of "
                                 f"{m}) is not final")
            windows[f"{cond}/{m}"] = window_for(st["selected"] / 10)
            sources[f"{cond}/{m}"] = {"resnet18_selected": st["selected"],
                                      "of": src, "from": "results/cifar/fig3"}
    return windows, sources


def protocol_spec(fig3_p: dict | None = None,
                  fig3_root: str | os.PathLike = FIG3,
                  methods: tuple[str, ...] = METHODS_VIT) -> dict:
    """The ViT protocol: the Fig. 3 protocol ``fig3_p`` (as amended) with the ViT, the
    50-epoch ``half`` schedule, ``methods`` in both conditionings and their windows
    (:func:`vit_windows`); no ablations."""
    f = load_protocol() if fig3_p is None else fig3_p
    windows, sources = vit_windows(tuple(methods), f, fig3_root)
    return {
        "name": "vit",
        "what": "Beyond the paper: the Fig. 3 comparison on a Vision Transformer "
                "(studies.cifar.vit: patch 4, width 192, depth 6, 3 heads, MLP "
                "ratio 4, pre-norm; 2.69 M parameters) with the same data, "
                "augmentation, ill-conditioned output (DiagonalConditioning, "
                "condition 1e7), grid, "
                "validation split, selection, extension, early-stop and verdict rules "
                "and seeds as the ResNet-18's Fig. 3 protocol, at 50 epochs.",
        "dataset": f["dataset"], "conditionings": list(f["conditionings"]),
        "methods": {"both": list(methods)}, "grid": list(f["grid"]),
        "settings": {**f["settings"], "model": "vit", "epochs": EPOCHS,
                     "schedule": "half"},
        "split": f["split"], "windows": windows, "window_sources": sources,
        "window_rule": "The first steps tried for a method: the step the ResNet-18's "
                       "Fig. 3 selection chose for it in the same conditioning (AdamW: "
                       "Adam's; KWNG every 20 steps: KWNG's) with its two grid "
                       "neighbours (the two nearest inner values at an end of the "
                       "grid).",
        "horizon": "50 epochs, the step x0.1 after epoch 25 (the authors' schedule "
                   "shape at half its length): on one H200 a captured exact KWNG step "
                   "of the ViT takes 10.9 ms and a captured SGD step 3.2 ms "
                   "(results/vit/step_cost_vit.json), so 50 epochs of the slowest "
                   "method take about 200 s, as long as a Fig. 3 run",
        **{k: f[k] for k in ("extension_rule", "selection_rule", "early_stop_rule",
                             "early_stop", "early_stop_text", "seeds", "seeds_text",
                             "verdict_rule")},
        "ablations": {"conditioning": "ill", "lr_of": "kwng", "runs": {}},
        "ablations_text": "none",
        "order": list(methods),
        "order_text": "The grids in the order of 'methods', then the seeds of every "
                      "final selection.",
        "kfac_on_tokens": "KFAC's factors of a linear layer that acts on the 65 "
                          "tokens of an image take each token as a row (KFAC-expand, "
                          "Eschenhagen et al. 2023), G divided by the tokens per image "
                          "(studies.cifar.kfac_tokens); the layer norms, class token "
                          "and position embedding take their plain gradient",
        "not_included": "EKFAC: it runs on the ViT too, but is left out to keep the "
                        "study within two GPU holds; KFAC stands for the "
                        "Kronecker-factored methods",
    }


def load_vit_protocol(path: str | os.PathLike = PROTOCOL_FILE) -> dict:
    """The committed ViT protocol (:func:`studies.fig3.protocol.load_protocol`: the
    Fig. 3 checks and amendments), checked to be the ViT study's."""
    p = load_protocol(path)
    if p.get("name") != "vit" or p["settings"].get("model") != "vit":
        raise ValueError(f"{path} is not the ViT protocol (name {p.get('name')!r}, "
                         f"model {p['settings'].get('model')!r})")
    return p


def vit_plan(common: dict, root: str | os.PathLike = VIT,
             path: str | os.PathLike = PROTOCOL_FILE) -> list[dict]:
    """The runs of the ViT protocol still to make (plan ``vit``): the Fig. 3 queue
    (:func:`studies.fig3.plan.fig3_plan`) on the ViT protocol and its records."""
    return fig3_plan(common, load_vit_protocol(path), root, protocol_commit(path))


def vit_check(root: str | None) -> int:
    """``cifar check --suite vit``: the Fig. 3 check
    (:func:`studies.fig3.plan.fig3_check`) on the ViT protocol and its records; exit 1
    if a record is bad or unfinished."""
    return fig3_check(root, load_vit_protocol(), VIT)


def main(argv: list[str] | None = None) -> int:
    """``python -m studies vit-protocol --out FILE``: write the protocol once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vit-protocol"]:
        argv = argv[1:]
    ap = argparse.ArgumentParser(prog="python -m studies vit-protocol",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(PROTOCOL_FILE))
    a = ap.parse_args(argv)
    out = Path(a.out)
    if out.exists():
        print(f"{out} exists: a protocol is never overwritten", file=sys.stderr)
        return 1
    atomic_write_json(out, protocol_spec())
    print(f"wrote {out}")
    return 0


register_plan("vit", lambda common, **_: vit_plan(common))
register_check("vit", lambda a: vit_check(a.root))
