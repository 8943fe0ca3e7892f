"""The amortized KWNG step (``refresh_every=k``) under the Fig. 3 protocol, and its
seed study (book chapter :ref:`cifar-amortized`). Importing it registers the plans
``amortized`` and ``amortized_seeds`` and the check ``amortized_seeds``."""

from studies.fig3.amortized import plan, seed_study  # noqa: F401  (they register)
