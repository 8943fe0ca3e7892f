"""What every study shares: provenance and atomic result files, the guards that keep
committed results, option checks, run locks, the figure style and markdown tables."""
