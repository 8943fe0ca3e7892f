"""The deep-learning engine: the preconditioner and what makes its step fast."""
