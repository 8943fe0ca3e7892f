"""The paper's Fig. 3 redone by its own protocol (book chapter :ref:`cifar-fig3`): the
protocol and its rules (:mod:`~studies.fig3.protocol`), its queues
(:mod:`~studies.fig3.plan`), its audit (:mod:`~studies.fig3.audit`), its clocks
(:mod:`~studies.fig3.clocks`), verdicts and tables; the amortized step, run under the
same protocol, in :mod:`studies.fig3.amortized`.

Importing it registers the early-stop rule ``fig3``, the plans ``fig3`` and
``fig3_audit`` and their completeness checks with the CIFAR kit."""

from studies.fig3 import audit, plan, protocol  # noqa: F401  (they register)
