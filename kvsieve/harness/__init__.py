"""Evaluation harness: grid definition (grid.py), runner, executors, the results store and reports."""
