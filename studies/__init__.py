"""The book's studies, beside the ``kwng`` library (not part of its distribution):
``python -m studies <name> [options]``.

* :mod:`studies.kit`: what every study shares (provenance, result guards, option
  checks, figure style, tables); :mod:`studies.cifar`: the CIFAR kit, which knows no
  study; :mod:`studies.toy`: the synthetic models' sweep setup, flows and grid.
* One package per study: :mod:`studies.synthetic`, :mod:`studies.fisher`,
  :mod:`studies.fig3` (with the amortized step, :mod:`studies.fig3.amortized`),
  :mod:`studies.authors100`, :mod:`studies.claim_suite`, :mod:`studies.study6`,
  :mod:`studies.bench`, :mod:`studies.vit`; and the claims ledger,
  :mod:`studies.claims`, the one place that reads several studies.

A study registers what the CIFAR kit calls by name (its plans, completeness checks and
early-stop rule: :mod:`studies.cifar.hooks`) when it is imported; :func:`load_all`
imports them all, as ``python -m studies`` does first. Each command writes its results
under the one results root ``results/`` (:data:`studies.kit.paths.RESULTS`) with a
``provenance.json``
(:mod:`studies.kit.provenance`).
"""

import importlib

#: the study packages, in the order :func:`load_all` imports them
STUDIES = ("studies.synthetic", "studies.fisher", "studies.fig3",
           "studies.fig3.amortized", "studies.authors100", "studies.claim_suite",
           "studies.study6", "studies.bench", "studies.vit")


def load_all() -> None:
    """Import every study, so that each has registered its plans, checks and
    early-stop rule with the CIFAR kit."""
    for name in STUDIES:
        importlib.import_module(name)


# name -> module implementing it (imported when the command runs)
EXPERIMENTS: dict[str, str] = {
    "relerr": "studies.synthetic.sweep",
    "bandwidth": "studies.synthetic.sweep",
    "flow": "studies.synthetic.sweep",
    "cifar": "studies.cifar.cli",
    "fisher": "studies.fisher.cli",
    "vit-protocol": "studies.vit.protocol",
}

#: name -> what the experiment is for (the help of ``python -m studies``)
PURPOSES: dict[str, str] = {
    "relerr": "relative error of KWNG against the exact WNG (Figs. 1 and 4)",
    "bandwidth": "relative error against a fixed Gaussian bandwidth (Fig. 5)",
    "flow": "W2 flow of the normal model: exact WNG, KWNG, Euclidean (Fig. 2)",
    "cifar": "CIFAR-10/100 classification: one run, sweeps, selection, timing "
             "(§4.2, Fig. 3; `cifar --help` lists its commands)",
    "fisher": "Fisher-Rao beside Wasserstein with the same kernel estimator",
    "vit-protocol": "write the ViT study's protocol once (results/vit/protocol.json)",
}
