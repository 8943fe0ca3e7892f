"""Experiment commands: ``python -m studies <name> [options]``.

Each experiment lives in its own module with a ``main(argv)`` function and writes its
results under ``results/<name>/`` with a ``provenance.json`` (see
:mod:`studies.kit.provenance`).
"""

# name -> module implementing it (imported lazily so that one experiment's dependencies
# never
# slow down another). Modules add themselves here.
EXPERIMENTS: dict[str, str] = {
    "relerr": "studies.synthetic.sweep",
    "bandwidth": "studies.synthetic.sweep",
    "flow": "studies.synthetic.sweep",
    "cifar": "studies.cifar.cli",
    "fisher": "studies.fisher.cli",
}

#: name -> what the experiment is for (the help of ``python -m studies``)
PURPOSES: dict[str, str] = {
    "relerr": "relative error of KWNG against the exact WNG (Fig. 1, Fig. 5)",
    "bandwidth": "relative error against a fixed Gaussian bandwidth (Fig. 6)",
    "flow": "W2 flow of the normal model: exact WNG, KWNG, Euclidean (Fig. 2)",
    "cifar": "CIFAR-10/100 classification: one run, sweeps, selection, timing "
             "(§4.2, Fig. 3; `cifar --help` lists its commands)",
    "fisher": "Fisher-Rao beside Wasserstein with the same kernel estimator",
}
