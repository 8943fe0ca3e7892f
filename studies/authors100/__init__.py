"""The authors'-horizon study: the paper's protocol at 100 epochs, a few methods
(book chapter :ref:`experiments-cifar`). Importing it registers the plans
``authors100`` and ``authors100_all`` and the check ``authors100``."""

from studies.authors100 import plan, records  # noqa: F401  (they register)
