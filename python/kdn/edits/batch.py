"""``kdn deposit``: many documents (a folder of text files or a JSONL file) into a store, with their
edits, resumably (a document whose exact KV and every edit are already stored is skipped)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kdn._core import InvalidInputError
from kdn.edits import parse_many

TEXT_FIELDS = ("text", "context", "document")


def documents(source: str | Path) -> list[tuple[str, str, list | None]]:
    """``(name, text, emphasize)`` triples: every ``*.txt`` / ``*.md`` file of a folder (sorted by
    name), or every line of a JSONL file (an object with a ``text``, ``context`` or ``document``
    field, an optional ``id`` and an optional ``emphasize``: ``[[start, end], ...]`` character spans
    a ``steer`` edit emphasizes, or ``"auto"``). A source that is neither, or a line without text, is an
    InvalidInputError."""
    source = Path(source)
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix in (".txt", ".md") and p.is_file())
        return [(p.name, p.read_text(encoding="utf-8"), None) for p in files]
    if not source.is_file():
        raise InvalidInputError(f"{source}: no such folder or file")
    docs = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"{source}:{number}: not JSON ({e.msg})") from None
        text = next((record[f] for f in TEXT_FIELDS if isinstance(record, dict) and isinstance(record.get(f), str)),
                    None)
        if text is None:
            raise InvalidInputError(f"{source}:{number}: no text field ({', '.join(TEXT_FIELDS)})")
        emphasize = record.get("emphasize")
        if emphasize is not None and not isinstance(emphasize, list) and emphasize != "auto":
            raise InvalidInputError(f"{source}:{number}: emphasize is a list of [start, end] character spans "
                                    "or \"auto\"")
        docs.append((str(record.get("id", number)), text, emphasize))
    return docs


def stored(kdn, model, ids: list[int], edits, keep_exact: bool = True) -> bool:
    """Whether the exact KV of ``ids`` (with ``keep_exact``: every chunk a store of them files, a
    tail too short for a probe not among them) and each edit's chunks (its last full chunk) are stored."""
    if keep_exact:
        session = kdn.session(model)
        filed, _ = kdn.engine.unheld(session, session.tokens(ids))
        if not all(kdn.engine.holds(key) for key in filed):
            return False
    keys = kdn.chunk_keys(model, ids)
    return not keys or all(kdn.engine.holds(edit.address(keys[-1])) for edit in edits)


def deposit_many(kdn, model, tokenizer, docs: list[tuple], edits=(), progress=None, keep_exact: bool = True) -> dict:
    """Deposit each document not stored yet (``keep_exact``: as :meth:`kdn.KDN.deposit`); returns
    counts, tokens, seconds and tokens/s."""
    edits = parse_many(edits)
    done = skipped = tokens = 0
    per_edit: dict = {}
    started = time.perf_counter()
    bar = progress(docs) if progress else docs
    for name, text, emphasize in bar:
        ids = list(tokenizer(text)["input_ids"])
        if stored(kdn, model, ids, edits, keep_exact):
            skipped += 1
            continue
        try:
            report = kdn.deposit(model, text, edits=edits, tokenizer=tokenizer, emphasize=emphasize,
                                 keep_exact=keep_exact)
        except InvalidInputError as e:
            raise InvalidInputError(f"document {name}: {e}") from None
        done += 1
        tokens += report["tokens"]
        for spec, r in report["edits"].items():
            total = per_edit.setdefault(spec, {"chunks": 0, "bytes": 0})
            total["chunks"] += r["chunks"]
            total["bytes"] += r["bytes"]
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
    kdn.flush()
    seconds = time.perf_counter() - started
    return {"deposited": done, "skipped": skipped, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "edits": per_edit}
