"""Evaluation harness: LongChat and multi-document QA, methods full / reuse (+ hooks), metrics, reports."""

from kdn.eval.datasets import DATASETS, DatasetNotFoundError, Sample, dataset_path, load_dataset
from kdn.eval.methods import register_method, resolve_method
from kdn.eval.metrics import line_accuracy, normalize_answer, qa_f1, topic_accuracy
from kdn.eval.runner import encode, run_eval

__all__ = ["DATASETS", "DatasetNotFoundError", "Sample", "dataset_path", "load_dataset", "register_method",
           "resolve_method", "line_accuracy", "normalize_answer", "qa_f1", "topic_accuracy", "encode", "run_eval"]
