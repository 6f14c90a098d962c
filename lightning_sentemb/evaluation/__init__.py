"""Evaluators: pure functions of an `encode` callable and a data directory (no Lightning inside)."""

from .analysis import analyze_sts_pairs, frequent_token_removal
from .clustering import evaluate_clustering
from .metrics import alignment, clustering_accuracy, uniformity
from .report import write_report
from .sts import evaluate_sts, sts_correlations
from .suite import EVALUATORS, evaluate_suite
from .transfer import evaluate_transfer

__all__ = [
    "EVALUATORS", "alignment", "analyze_sts_pairs", "clustering_accuracy", "evaluate_clustering", "evaluate_suite",
    "evaluate_sts", "evaluate_transfer", "frequent_token_removal", "sts_correlations", "uniformity", "write_report",
]
