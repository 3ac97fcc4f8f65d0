"""Edited caches in the tiers: the deposit that computes and files them (pruned chunks, steering
sidecars), the readers that serve them, and the HF cache that keeps a pruned cache's positions
(new tokens continue at the original length, not at the number of rows kept)."""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import DynamicCache

from kdn._core import InvalidInputError
from kdn.edits import Edit, autospans, kvzip, parse_many, steer
from kdn.engine.targets import HFTarget
from kdn.layout import cache_to_kv_list, kv_list_to_cache, output_cache


class PrunedCache(DynamicCache):
    """A DynamicCache holding fewer rows than the tokens it stands for: ``pruned`` tokens were
    dropped (per head), so positions (``get_seq_length``, hence ``cache_position`` and RoPE of new
    tokens) count them, while the attention mask spans the rows held and keeps new tokens causal."""

    pruned = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx) + self.pruned

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx)

    @classmethod
    def holding(cls, model, kv: list[torch.Tensor], tokens: int) -> PrunedCache:
        cache = kv_list_to_cache(model, kv)
        cache.__class__ = cls
        cache.pruned = tokens - kv[0].shape[2]
        return cache


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidInputError("deposit: a text needs tokenizer=... (or pass token ids)")
        return list(tokenizer(prompt)["input_ids"])
    return [int(t) for t in torch.as_tensor(prompt).reshape(-1).tolist()]


@torch.inference_mode()
def deposit(kdn, model, prompt, edits=(), tokenizer=None, emphasize=None) -> dict:
    """Prefill ``prompt`` (text with ``tokenizer``, or token ids), store its exact KV and, for each
    edit, its edited chunks (``kvzip``) or sidecars (``steer``: the ``emphasize`` spans, character
    ranges of a text or token ranges of ids, or ``"auto"``: the sentences the model itself names,
    :mod:`kdn.edits.autospans`) under the edit's addresses. Every edit is computed before anything
    is stored, so an edit that fails stores nothing for this prompt."""
    edits = parse_many(edits)
    session = kdn.session(model)
    ids = _prompt_ids(prompt, tokenizer)
    emphasized = offsets = None
    auto = isinstance(emphasize, str) and emphasize == "auto"
    if any(e.name == "steer" for e in edits):
        steer.check_model(model)
        offsets = tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"] if isinstance(prompt, str) else None
        if auto and offsets is None:
            raise InvalidInputError("deposit: emphasize='auto' needs the prompt as text and its tokenizer")
        emphasized = None if auto else steer.token_mask(emphasize, len(ids), offsets)
    tokens = session.tokens(ids)
    device = next(model.parameters()).device
    started = time.perf_counter()
    out = model(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    kv = cache_to_kv_list(output_cache(out))
    prefill_s = time.perf_counter() - started
    keys = session.prefix_keys(tokens)  # edited chunks: the full chunks (a reader's prompt goes on after them)
    chunk = session.chunk_size
    planned, sidecars, report = [], [], {}
    found = None
    if auto and emphasized is None:
        t0 = time.perf_counter()
        spans, answer = autospans.find(model, tokenizer, prompt, kv)
        if not spans:
            raise InvalidInputError(f"deposit: emphasize='auto' found no sentence of the text in the model's answer "
                                    f"({answer[:80]!r}); give the spans (emphasize=[(start, end), ...])")
        emphasized = steer.token_mask(spans, len(ids), offsets)
        found = {"spans": spans, "answer": answer, "seconds": time.perf_counter() - t0}
    for edit in edits:
        t0 = time.perf_counter()
        if edit.name == "steer":
            if head_profile(kdn, model, tokenizer) is None:
                raise InvalidInputError("deposit: steering profiles the model's heads once; pass tokenizer=...")
            mine = [(edit.address(key), steer.pack_flags(emphasized[i * chunk:(i + 1) * chunk]))
                    for i, key in enumerate(keys)]
            sidecars += mine
            nbytes = sum(len(p) for _, p in mine)
        else:
            chunks = _edited_chunks(model, kv, ids, keys, chunk, edit, tokenizer)
            planned += chunks
            nbytes = sum(t.nbytes for _, rows in chunks for t in rows)
        report[edit.spec] = {"chunks": len(keys), "bytes": nbytes, "seconds": time.perf_counter() - t0}
    exact = kdn.chunks.write(session, tokens, [t.cpu() for t in kv])
    for address, rows in planned:
        kdn.chunks.write_segment(session, address, rows, 0, rows[0].shape[2])
    for address, payload in sidecars:
        kdn.chunks.store_sidecar(session, address, payload)
    out = {"tokens": len(ids), "exact_tokens": exact, "prefill_seconds": prefill_s, "edits": report}
    return {**out, "auto_spans": found} if found else out


def head_profile(kdn, model, tokenizer=None) -> list | None:
    """The model's steering head profile (:func:`kdn.edits.steer.profile`): from the tiers, else
    computed (needs ``tokenizer``; once per model) and stored; None without either."""
    session = kdn.session(model)
    key = steer.profile_key(session.fingerprint)
    payload = kdn.chunks.read_sidecar(session, key)
    if payload is not None:
        return steer.unpack_profile(payload)
    if tokenizer is None:
        return None
    from kdn.data import velmora

    ranked = steer.profile(model, tokenizer, velmora())
    kdn.chunks.store_sidecar(session, key, steer.pack_profile(ranked))
    return ranked


def _edited_chunks(model, kv, ids, keys, chunk, edit: Edit, tokenizer) -> list[tuple[bytes, list]]:
    """``(address, rows)`` of each full chunk's edited form (rows: ``2 * layers`` CPU tensors)."""
    if edit.name != "kvzip":
        raise InvalidInputError(f"deposit: edit {edit.name!r} has no implementation")
    if not keys:
        return []
    instruction = list(tokenizer(kvzip.INSTRUCTION, add_special_tokens=False)["input_ids"]) if tokenizer else []
    scored = kvzip.scores(model, kv, ids, instruction)
    keep, sink = edit.param("keep"), int(edit.param("sink"))
    return [(edit.address(key), [t.cpu() for t in kvzip.prune(kv, scored, i * chunk, (i + 1) * chunk, keep, sink)])
            for i, key in enumerate(keys)]


def steering(kdn, model, tokens, limit: int, edit: Edit) -> tuple[dict, int] | None:
    """``(biases, tokens)`` of a ``steer`` edit for the prompt ``tokens``: the sidecars of its leading
    full chunks (within ``limit``) as per-layer biases (:func:`kdn.edits.steer.biases`) over the
    tokens they cover; None when the first chunk has none or the model has no stored profile."""
    session = kdn.session(model)
    keys = session.prefix_keys(tokens)[: limit // session.chunk_size]
    flags = []
    for key in keys:
        payload = kdn.chunks.read_sidecar(session, edit.address(key))
        if payload is None:
            break
        flags.append(steer.unpack_flags(payload))
    ranked = head_profile(kdn, model) if flags else None
    if not ranked:
        return None
    config = model.config
    heads = steer.chosen(ranked, int(edit.param("heads")))
    emphasized = np.concatenate(flags)
    return steer.biases(heads, edit.param("alpha"), emphasized, config.num_attention_heads,
                        config.num_hidden_layers), len(emphasized)


def read(kdn, model, tokens, limit: int, edits) -> tuple[PrunedCache | None, int, str | None]:
    """``(cache, hit, edit)``: the longest run of full chunks of ``tokens`` (within ``limit``) stored
    under the first of ``edits`` that has any, as a :class:`PrunedCache` on the model's device;
    ``(None, 0, None)`` when none has. An unusable blob ends the hit there and is dropped
    (:meth:`kdn.engine.ChunkIO.read_segment`: an edited chunk is filed like a segment, at position 0)."""
    session = kdn.session(model)
    keys = session.prefix_keys(tokens)[: limit // session.chunk_size]
    target = HFTarget(next(model.parameters()).device)
    for edit in parse_many(edits):
        if edit.name != "kvzip":
            continue
        rows = kvzip.kept(edit.param("keep"), session.chunk_size)
        parts = []
        for key in keys:
            part = kdn.chunks.read_segment(session, edit.address(key), 0, rows, target)
            if part is None:
                break
            parts.append(part)
        if parts:
            kv = [torch.cat([p[j] for p in parts], dim=2) for j in range(len(parts[0]))]
            return PrunedCache.holding(model, kv, len(parts) * session.chunk_size), len(parts) * session.chunk_size, \
                edit.spec
    return None, 0, None
