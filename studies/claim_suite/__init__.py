"""The 30-epoch claim suite (book chapters :ref:`experiments-cifar` and
:ref:`cifar-6epoch`). Importing it registers the plans ``claim_select`` and
``claim``."""

from studies.claim_suite import plan, records  # noqa: F401  (they register)
