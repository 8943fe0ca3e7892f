"""The earlier 6-epoch study, frozen as data (``study6.json``; book chapter
:ref:`cifar-6epoch`)."""

from studies.study6 import records  # noqa: F401  (it registers)
