"""Answer metrics of the evaluations: topic accuracy, line accuracy, QA F1 (SQuAD/LongBench normalization)."""

from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD v1.1)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the normalized whitespace tokens of ``prediction`` against one ``gold`` answer."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: list[str]) -> float:
    """Best token F1 over the gold ``answers`` (LongBench ``qa_f1_score``)."""
    return max((token_f1(prediction, a) for a in answers), default=0.0)


def exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 if the normalized prediction equals one normalized gold answer (SQuAD EM)."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def topic_accuracy(prediction: str, topic: str) -> float:
    """1.0 if the normalized gold topic occurs in the normalized prediction (LongChat topic retrieval)."""
    gold = normalize_answer(topic)
    return float(bool(gold) and gold in normalize_answer(prediction))


def line_accuracy(prediction: str, expected: int | str) -> float:
    """1.0 if the last integer in the prediction equals the expected number (LongChat line retrieval)."""
    numbers = re.findall(r"\d+", prediction)
    return float(bool(numbers) and int(numbers[-1]) == int(expected))


METRICS = {"topic_accuracy": topic_accuracy, "line_accuracy": line_accuracy, "qa_f1": qa_f1}
