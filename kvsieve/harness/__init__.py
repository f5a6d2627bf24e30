"""Evaluation harness: the results store and the reports built from it."""

from kvsieve.harness.report import format_table, plot_scores, plot_task_panels, score_table
from kvsieve.harness.store import CellKey, CellResult, ResultsStore, SchemaVersionError

__all__ = ["CellKey", "CellResult", "ResultsStore", "SchemaVersionError", "score_table", "format_table",
           "plot_scores", "plot_task_panels"]
