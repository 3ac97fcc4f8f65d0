"""Emphasized spans found by the model itself (AutoPASTA, arXiv 2409.10790), for a ``steer`` edit
deposited with ``emphasize="auto"``.

AutoPASTA asks the model which sentence of the context answers the question and steers attention
to it. At deposit no question is known yet, so the model is asked for the sentences that state the
text's most important facts: it continues the deposit's own KV (no second prefill) with
:data:`INSTRUCTION`, greedily, and the sentences of the text it copied (most of their words in its
answer) become the emphasized spans.

Example:
    >>> text = "The sky was grey. Tom found a gold key under the old bridge. He went home."
    >>> match(text, "Tom found a gold key under the bridge")
    [(18, 60)]
"""

from __future__ import annotations

import re

import torch

from kdn._core import InvalidInputError
from kdn.layout import cache_arg, kv_list_to_cache

INSTRUCTION = "\n\nCopy, word for word, the sentence of the text above that states its most important fact:\n"
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)")
_WORD = re.compile(r"\w+")


def sentences(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences of ``text`` (ends at ``.``, ``!``, ``?`` or a line break;
    surrounding spaces left out)."""
    spans = []
    for m in _SENTENCE.finditer(text):
        start, end = m.start(), m.end()
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if start < end:
            spans.append((start, end))
    return spans


def match(text: str, answer: str, limit: int = 2, share: float = 0.6) -> list[tuple[int, int]]:
    """The sentences of ``text`` the ``answer`` copied: at least ``share`` of a sentence's words (and
    three or more) appear in it; the ``limit`` best, in text order."""
    said = {w.lower() for w in _WORD.findall(answer)}
    scored = []
    for start, end in sentences(text):
        words = [w.lower() for w in _WORD.findall(text[start:end])]
        if len(words) >= 3:
            got = sum(w in said for w in words) / len(words)
            if got >= share:
                scored.append((-got, start, end))
    return sorted((start, end) for _, start, end in sorted(scored)[:limit])


@torch.inference_mode()
def find(model, tokenizer, text: str, kv: list, max_new_tokens: int = 48) -> tuple[list, str]:
    """``(spans, answer)``: the model's answer to :data:`INSTRUCTION` after ``text`` (whose KV is
    ``kv``, HF per-layer tensors, left unchanged) and the sentences it names (:func:`match`)."""
    if tokenizer is None or not isinstance(text, str):
        raise InvalidInputError("steer: emphasize='auto' needs the text and its tokenizer")
    device = next(model.parameters()).device
    cache = kv_list_to_cache(model, kv)  # extended by concatenation: the deposit's tensors stay as they are
    step = torch.tensor([tokenizer(INSTRUCTION, add_special_tokens=False)["input_ids"]], device=device)
    eos = {model.config.eos_token_id} if isinstance(model.config.eos_token_id, int) else set(
        model.config.eos_token_id or ())
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(step, **cache_arg(cache), use_cache=True, logits_to_keep=1).logits[0, -1]
        token = int(torch.argmax(logits))
        if token in eos:
            break
        out.append(token)
        said = tokenizer.decode(out).lstrip()
        if said and "\n" in said:  # one line: the copied sentence
            break
        step = torch.tensor([[token]], device=device)
    answer = tokenizer.decode(out).strip()
    return match(text, answer), answer

