"""Evaluation datasets: LongChat topic and line retrieval, multi-document QA in the CacheBlend schema.

Every sample becomes context ``segments`` (cached by kdn), a ``query`` asked after them, the gold
answers and the metric that scores them. Files are read in place from a data folder: ``--data-dir``,
else ``$KDN_DATA``, else ``$KDN_SHARED/data`` (see :func:`kdn.models.paths.data_dirs`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kdn._core import InvalidInputError
from kdn.models.paths import data_dirs

QA_INSTRUCTION = ("Read the passages below, then answer the question that follows with a few words taken "
                  "from them.\n\n")
QA_QUERY = "\n\nAnswer the question in a few words, based on the passages.\nQuestion: {question}\nAnswer:"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One evaluation item: context ``segments`` then ``query`` (which starts with its own separator);
    ``answers`` are scored by ``metric`` (a name in :data:`kdn.eval.metrics.METRICS`)."""

    id: str
    segments: tuple[str, ...]
    query: str
    answers: tuple[str, ...]
    metric: str


# name -> path under the data folder
DATASETS = {
    "longchat-topics-5": "LongChat/topics/5_topics.jsonl",
    "longchat-topics-10": "LongChat/topics/10_topics.jsonl",
    "longchat-topics-15": "LongChat/topics/15_topics.jsonl",
    "cachegen-longchat": "CacheGen/longchat.jsonl",
    "longchat-lines-200": "LongChat/lines/200_lines.jsonl",
    "longchat-lines-300": "LongChat/lines/300_lines.jsonl",
    "musique": "CacheBlend/musique_s.json",
}


def _split(prompt: str, marker: str, where: str) -> tuple[str, str]:
    at = prompt.find(marker)
    if at < 0:
        raise InvalidInputError(f"{where}: the prompt has no {marker!r}; is this a LongChat file?")
    return prompt[:at].rstrip(), prompt[at:]


def _strip_turn(text: str) -> str:
    """CacheGen's prompts end with the next turn's ' ASSISTANT:'; the chat template adds its own."""
    text = text.rstrip()
    return text[: -len("ASSISTANT:")].rstrip() if text.endswith("ASSISTANT:") else text


def longchat_topics(path: Path) -> list[Sample]:
    samples = []
    for n, line in enumerate(path.read_text().splitlines()):
        record = json.loads(line)
        context, query = _split(record["prompt"], "Now the record ends.", f"{path}:{n + 1}")
        topics = record.get("topics") or record.get("label")
        samples.append(Sample(f"{path.stem}-{record.get('test_id', n)}", (context,), " " + _strip_turn(query),
                              (topics[0],), "topic_accuracy"))
    return samples


def longchat_lines(path: Path) -> list[Sample]:
    samples = []
    for n, line in enumerate(path.read_text().splitlines()):
        record = json.loads(line)
        context, query = _split(record["prompt"], "Now the record is over.", f"{path}:{n + 1}")
        samples.append(Sample(f"{path.stem}-{n}", (context,), "\n\n" + query.strip(), (str(record["expected_number"]),),
                              "line_accuracy"))
    return samples


def multidoc_qa(path: Path) -> list[Sample]:
    """CacheBlend schema: a JSON list of ``{"ctxs": [{"title", "text"}], "question", "answers"}``."""
    records = json.loads(path.read_text())
    if not isinstance(records, list) or not records or "ctxs" not in records[0]:
        raise InvalidInputError(f"{path}: expected a JSON list of {{ctxs, question, answers}} records")
    samples = []
    for n, r in enumerate(records):
        passages = [f"Title: {c['title']}\n{c['text'].strip()}\n\n" for c in r["ctxs"]]
        passages[0] = QA_INSTRUCTION + passages[0]
        samples.append(Sample(f"{path.stem}-{n}", tuple(passages), QA_QUERY.format(question=r["question"]),
                              tuple(r["answers"]), "qa_f1"))
    return samples


class DatasetNotFoundError(InvalidInputError):
    """A named dataset is in none of the data folders, or a dataset file does not exist."""


def dataset_path(name_or_path: str, data_dir=None) -> Path:
    """The file of a named dataset (first data folder that has it) or the given file path."""
    if name_or_path not in DATASETS:
        path = Path(name_or_path)
        if path.is_file():
            return path
        raise DatasetNotFoundError(f"dataset {name_or_path!r}: no such file; known names: {', '.join(DATASETS)}")
    candidates = [d / DATASETS[name_or_path] for d in data_dirs(data_dir)]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise DatasetNotFoundError(f"dataset {name_or_path!r} not found; looked in: {looked}. "
                               "Point --data-dir (or $KDN_DATA) at the folder that holds it.")


def load_dataset(name_or_path: str, limit: int | None = None, data_dir=None) -> list[Sample]:
    """Samples of a named dataset (see ``DATASETS``) or of a file in one of the three schemas.

    ``data_dir`` overrides where named datasets are looked for (default: ``$KDN_DATA``, then
    ``$KDN_SHARED/data``, then a clone's ``tests/data`` slices; see :func:`kdn.models.paths.data_dirs`).

    Example:
        >>> samples = load_dataset("longchat-topics-5", limit=2)
        >>> samples[0].answers
        ('The psychology of creativity',)
    """
    path = dataset_path(name_or_path, data_dir)
    if path.suffix == ".json":
        samples = multidoc_qa(path)
    else:
        first = json.loads(path.read_text().split("\n", 1)[0])
        samples = longchat_lines(path) if "expected_number" in first else longchat_topics(path)
    return samples[:limit] if limit is not None else samples
