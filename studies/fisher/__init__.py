"""Fisher–Rao beside Wasserstein with the same kernel estimator; book chapter
:ref:`fisher-rao`."""
