"""The theory companions: the chapters' reference computations."""
