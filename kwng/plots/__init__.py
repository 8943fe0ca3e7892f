"""Figures and tables drawn from result files."""
