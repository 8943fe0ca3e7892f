"""Experiment commands: ``python -m kwng.experiments <name> [options]``.

Each experiment lives in its own module with a ``main(argv)`` function and writes its
results under ``results/<name>/`` with a ``provenance.json`` (see
:mod:`kwng.experiments.provenance`).
"""

# name -> module implementing it (imported lazily so that one experiment's dependencies
# never
# slow down another). Modules add themselves here.
EXPERIMENTS: dict[str, str] = {
    "relerr": "kwng.experiments.synthetic",
    "bandwidth": "kwng.experiments.synthetic",
    "flow": "kwng.experiments.synthetic",
    "cifar": "kwng.experiments.cifar.cli",
    "fisher": "kwng.experiments.fisher",
}
