"""Edited caches in the tiers: the deposit that computes and files them (pruned chunks, steering
sidecars), the readers that serve them, and the HF cache that keeps a pruned cache's positions
(new tokens continue at the original length, not at the number of rows kept)."""

from __future__ import annotations

import dataclasses
import struct
import time

import numpy as np
import torch
from transformers import DynamicCache

from kdn import _core
from kdn._core import InvalidInputError
from kdn.edits import Edit, kvzip, parse_many, steer
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


_TAIL = struct.Struct("<I")  # a deposit's record of its partial last chunk: how many tokens it holds


def tail_address(edit: Edit, last_key: bytes) -> bytes:
    """Where a deposit of ``edit`` records the partial chunk it stored after its last full chunk
    (``last_key``): an edited reader serves exact KV up to there, never KV stored past it."""
    return _core.blake3(b"kdn/deposit-tail\0" + edit.address(last_key), 16)


@dataclasses.dataclass
class Deposit:
    """One deposit as its edits see it (:class:`kdn.edits.EditKind`): the prompt, its prefill's KV and
    full chunks' ``keys`` (after the prefill), and what the edits file: ``planned`` rows
    ``(address, rows, position, tokens)`` and ``sidecars`` ``(address, payload)``."""

    kdn: object
    model: object
    session: object
    prompt: object
    ids: list
    tokenizer: object = None
    emphasize: object = None
    auto: bool = False  # emphasize="auto": the spans the model itself names
    kv: list | None = None
    keys: list = dataclasses.field(default_factory=list)
    tail: int = 0  # tokens after the last full chunk
    planned: list = dataclasses.field(default_factory=list)
    sidecars: list = dataclasses.field(default_factory=list)
    layout_masked: bool = False  # kvzip's chunks in the masked layout (a kvtc tier)
    scored: object = None  # kvzip's scores, shared by its edits
    offsets: list | None = None  # steer: the text's token offsets
    emphasized: object = None  # steer: the token mask
    found: dict | None = None  # steer "auto": the spans found


@torch.inference_mode()
def deposit(kdn, model, prompt, edits=(), tokenizer=None, emphasize=None, keep_exact: bool = True) -> dict:
    """Prefill ``prompt`` (text with ``tokenizer``, or token ids), store its exact KV and, for each
    edit, its edited chunks (``kvzip``) or sidecars (``steer``: the ``emphasize`` spans, character
    ranges of a text or token ranges of ids, or ``"auto"``: the sentences the model itself names,
    :mod:`kdn.edits.autospans`) under the edit's addresses. Every edit is computed before anything
    is stored, so an edit that fails stores nothing for this prompt. ``keep_exact=False``: only the
    edited form and the partial last chunk it is served with (exact readers then miss the prompt;
    a ``steer`` edit serves the exact KV, so it needs it)."""
    edits = parse_many(edits)
    if not keep_exact and (not edits or any(e.kind.serves_exact for e in edits)):
        raise InvalidInputError("deposit: keep_exact=False stores only pruned (kvzip) edits; a steer edit serves the "
                                "exact KV, and no edit leaves nothing to store")
    session = kdn.session(model)
    if session.layout.latent and edits:
        raise InvalidInputError("deposit: edits are not supported on an MLA model (kvzip scores and steering work on "
                                "per-head attention; its cache is one latent vector per token)")
    ids = _prompt_ids(prompt, tokenizer)
    d = Deposit(kdn, model, session, prompt, ids, tokenizer, emphasize,
                auto=isinstance(emphasize, str) and emphasize == "auto")
    for kind in dict.fromkeys(e.kind for e in edits):
        kind.prepare(d)
    tokens = session.tokens(ids)
    device = next(model.parameters()).device
    started = time.perf_counter()
    out = model(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    d.kv = cache_to_kv_list(output_cache(out))
    prefill_s = time.perf_counter() - started
    d.keys = session.prefix_keys(tokens)  # edited chunks: the full chunks (a reader's prompt goes on after them)
    report = {}
    for edit in edits:
        t0 = time.perf_counter()
        nbytes = edit.kind.compute(d, edit)
        report[edit.spec] = {"chunks": len(d.keys), "bytes": nbytes, "seconds": time.perf_counter() - t0}
    kv = d.kv = [t.cpu() for t in d.kv]
    chunk, keys = session.chunk_size, d.keys
    full, d.tail = len(keys) * chunk, len(ids) - len(keys) * chunk
    if keep_exact:
        exact = kdn.save(session, tokens, kv)
    else:  # the partial last chunk alone, as an exact store files it: what edited readers serve after
        exact = 0
        if d.tail and keys:
            tail_key = session.prefix_keys(tokens, include_partial=True)[-1]
            exact = full + d.tail if kdn.segments.write(session, tail_key, kv, full, d.tail) else 0
    for edit in edits:
        edit.kind.after(d, edit)
    for address, rows, position, count in d.planned:  # rows before the masks that lead readers to them
        kdn.segments.write(session, address, rows, position, count)
    for address, payload in d.sidecars:
        kdn.sidecars.write(session, address, payload)
    out = {"tokens": len(ids), "exact_tokens": exact, "prefill_seconds": prefill_s, "edits": report}
    return {**out, "auto_spans": d.found} if d.found else out


def tail_sidecar(edit: Edit, last_key: bytes, tail: int) -> tuple[bytes, bytes]:
    """The record a deposit of ``edit`` files of the ``tail`` tokens it stored after its last full
    chunk (``last_key``): ``(address, payload)``."""
    return tail_address(edit, last_key), _TAIL.pack(tail)


def rope_of(model) -> torch.Tensor | None:
    """The model's RoPE frequencies (pooled keys are moved to their rows, :func:`kdn.edits.kvzip.pool`),
    or None for a model whose RoPE kdn does not move (its keys are pooled unmoved; writer and reader
    decide alike)."""
    from kdn.rope import UnsupportedModelError, inv_freq

    try:
        return inv_freq(model)
    except UnsupportedModelError:
        return None


def head_profile(kdn, model, tokenizer=None) -> list | None:
    """The model's steering head profile (:func:`kdn.edits.steer.profile`): from the tiers, else
    computed (needs ``tokenizer``; once per model) and stored; None without either."""
    session = kdn.session(model)
    key = steer.profile_key(session.fingerprint)
    payload = kdn.sidecars.read(session, key)
    if payload is not None:
        return steer.unpack_profile(payload)
    if tokenizer is None:
        return None
    from kdn.data import velmora

    ranked = steer.profile(model, tokenizer, velmora())
    kdn.sidecars.write(session, key, steer.pack_profile(ranked))
    return ranked


def masked_layout(kdn, session) -> bool:
    """Whether a kvzip deposit files its chunks in the masked layout (:func:`kdn.edits.kvzip.masked`):
    when a tier stores ``kvtc``, whose rows are tokens and cannot hold pooled rows (measured: relative
    key error 0.10 -> 0.50 at keep 0.5 on SmolLM2; 0/5 right where int4 kept 5/5 on Qwen2.5-1.5B).
    That needs the model's kvtc calibration to have per-head bases; otherwise the deposit is refused
    at the call, before anything is computed. Other codecs code pooled rows (fewer bytes)."""
    codecs = {name: str(getattr(kdn.config, name, "raw")) for name in ("memory_codec", "disk_codec", "remote_codec")}
    kvtc_tiers = [f"{name}={codec!r}" for name, codec in codecs.items() if codec.startswith("kvtc")]
    if not kvtc_tiers:
        return False
    calibration = _core.kvtc_model_calibration(session.fingerprint)
    if calibration is None and kdn.calibrations.load(session):
        calibration = _core.kvtc_model_calibration(session.fingerprint)
    if calibration is None or not calibration["per_head"]:
        raise InvalidInputError(f"deposit: kvzip with {', '.join(kvtc_tiers)} needs the model's kvtc calibration "
                                "with per-head bases (KDN.calibrate(model, contexts, per_head=True)); "
                                + ("none is loaded" if calibration is None else "the loaded one has joint bases"))
    return True


def edited_chunks(kv, scored, keys, chunk, edit: Edit, inv_freq, layout_masked: bool) -> tuple[list, list]:
    """``([(rows address, rows, position, tokens)], [(edit address, mask)])`` of each full chunk's
    ``kvzip`` form from the context's reconstruction ``scored``: rows ``2 * layers`` CPU tensors
    pooled by :func:`kdn.edits.kvzip.pool` (the segment ``[0, rows)``), or the whole context in the
    :func:`kdn.edits.kvzip.masked` layout (the segment is the chunk, at its own position, so a codec
    that undoes RoPE by position sees its keys where they were computed); mask: its packed
    bitmask, which says the layout."""
    if not keys:
        return [], []
    mask = kvzip.chosen(scored, len(keys) * chunk, edit.param("keep"), int(edit.param("sink")))
    whole = [t.cpu() for t in kvzip.masked(kv, mask, 0)] if layout_masked else None
    rows, masks = [], []
    for i, key in enumerate(keys):
        part = mask[:, :, i * chunk:(i + 1) * chunk]
        payload = kvzip.pack_mask(part, layout_masked)
        masks.append((edit.address(key), payload))
        address = kvzip.rows_address(edit.address(key), payload)
        if layout_masked:
            rows.append((address, whole, i * chunk, chunk))
        else:
            pooled = [t.cpu() for t in kvzip.pool(kv, part, i * chunk, inv_freq)]
            rows.append((address, pooled, 0, pooled[0].shape[2]))
    return rows, masks


def steering(kdn, model, tokens, limit: int, edit: Edit) -> tuple[dict, int] | None:
    """``(biases, tokens)`` of a ``steer`` edit for the prompt ``tokens``: the sidecars of its leading
    full chunks (within ``limit``) as per-layer biases (:func:`kdn.edits.steer.biases`) over the
    tokens they cover; None when the first chunk has none or the model has no stored profile."""
    session = kdn.session(model)
    keys = session.prefix_keys(tokens)[: limit // session.chunk_size]
    flags = [steer.unpack_flags(p) for p in kdn.sidecars.read_many(session, [edit.address(k) for k in keys])]
    ranked = head_profile(kdn, model) if flags else None
    if not ranked:
        return None
    config = model.config
    heads = steer.chosen(ranked, int(edit.param("heads")))
    emphasized = np.concatenate(flags)
    return steer.biases(heads, edit.param("alpha"), emphasized, config.num_attention_heads,
                        config.num_hidden_layers), len(emphasized)


def read(kdn, model, tokens, limit: int, edit: Edit) -> tuple[PrunedCache | None, int, str | None, dict | None]:
    """``(cache, hit, edit, bias)``: the longest run of full chunks of ``tokens`` (within ``limit``)
    stored under the ``kvzip`` ``edit``, then the stored KV of the prompt past that
    run (:func:`exact_rest`: the deposit's partial last chunk, which no edit covers), as a
    :class:`PrunedCache` on the model's device, and the attention bias that hides its padding rows
    (run the model under :func:`kdn.edits.steer.applied`; None when no head was padded);
    ``(None, 0, None, None)`` when none has. A chunk whose mask or rows are missing or unusable
    ends the edited run there (an unusable blob is dropped: :meth:`kdn.engine.parts.Segments.read`)."""
    session = kdn.session(model)
    keys = session.prefix_keys(tokens)[: limit // session.chunk_size]
    target = HFTarget(next(model.parameters()).device)
    layers, heads = session.layout.layers, session.layout.kv_heads
    addresses = [edit.address(key) for key in keys]
    rows, masks = [], []  # masks first, then every chunk's rows: two round trips for the whole hit
    for address, payload in zip(addresses, kdn.sidecars.read_many(session, addresses)):
        mask = kvzip.unpack_mask(payload, layers, heads, session.chunk_size)
        if mask is None:
            break
        masked = kvzip.is_masked(payload, mask)  # a masked chunk is stored at its own position
        rows.append((kvzip.rows_address(address, payload), len(rows) * session.chunk_size if masked else 0,
                     kvzip.stored_rows(payload, mask)))
        masks.append((mask, masked))
    got = kdn.segments.read_many(session, rows, target)
    parts = [(mask, chunk_rows, layout) for (mask, layout), chunk_rows in zip(masks, got)]
    if not parts:
        return None, 0, None, None
    kv, held = kvzip.unpool(parts, rope_of(model))
    deposited = keys[:len(masks)]  # the deposit's full chunks as far as this reader shares them
    tail = deposit_tail(kdn, session, edit, deposited)
    rest, count = [], 0
    if len(parts) == len(deposited):  # the whole edited run: then the deposit's last chunk, by its key
        rest, count = tail_kv(kdn, session, tokens, limit, deposited, tail, target)
    if not count:  # else the exact KV stored past the run, up to where the deposit ended
        end = len(deposited) * session.chunk_size + tail
        rest, count = exact_rest(kdn, session, tokens, min(limit, end), len(parts), target)
    if count:
        kv = [torch.cat([pruned, exact], 2) for pruned, exact in zip(kv, rest)]
    hit = len(parts) * session.chunk_size + count
    bias = kvzip.padding_bias(held, model.config.num_attention_heads, after=count)
    return PrunedCache.holding(model, kv, hit), hit, edit.spec, bias or None


def deposit_tail(kdn, session, edit: Edit, keys: list) -> int:
    """How many tokens the deposit of ``edit`` whose full chunks are ``keys`` (those whose masks a
    reader found) stored after them: its partial last chunk, recorded at :func:`tail_address`."""
    record = kdn.sidecars.read(session, tail_address(edit, keys[-1])) if keys else None
    tail = _TAIL.unpack(record)[0] if record is not None and len(record) == _TAIL.size else 0
    return tail if 0 < tail < session.chunk_size else 0


def tail_kv(kdn, session, tokens, limit: int, keys: list, tail: int, target) -> tuple[list, int]:
    """``(kv, count)``: the deposit's partial last chunk (``tail`` tokens after the full chunks
    ``keys``), read by its key when the reader's tokens there are the deposit's (whether or not the
    deposit kept its exact KV), within ``limit``; ``([], 0)`` otherwise."""
    start = len(keys) * session.chunk_size
    count = min(tail, limit - start)
    if not tail or count <= 0 or start + tail > len(tokens):
        return [], 0
    key = session.chunk_key(keys[-1], tokens[start:start + tail])
    got = kdn.segments.read_many(session, [(key, start, tail)], target, exact=True)
    return ([t[:, :, :count] for t in got[0]], count) if got else ([], 0)


def exact_rest(kdn, session, tokens, limit: int, chunks: int, target) -> tuple[list, int]:
    """``(kv, count)``: the KV of ``tokens`` past their first ``chunks`` chunks as far as it is
    stored exactly (within ``limit``, which a reader sets at the end of the deposit it is served:
    the deposit's end, never KV a later request stored past it, computed over the unedited prompt;
    token-granular: a deposit stores its partial last chunk), ``count`` tokens of ``2 * layers``
    tensors ``[1, kv_heads, count, head_dim]`` on ``target``; ``([], 0)`` when nothing more is. An
    edited hit serves it after its edited chunks: rows a pruning keeps whole (KVzip prunes the rows
    of a full prefill; these are such rows). A coded copy (a ``kvtc`` tier's) is not served here:
    those rows sit right before the question, and recomputed they kept answers closer to a full
    prefill's (docs/results/editing.md, "Edited hits serve the deposit's partial last chunk")."""
    chunk = session.chunk_size
    found = kdn.find(session, tokens, limit)
    if found.tokens <= chunks * chunk:
        return [], 0
    keys = found.keys[chunks:]
    sizes = [chunk] * len(keys)
    if found.last_tokens:
        sizes[-1] = found.last_tokens
    got = kdn.segments.read_many(session, [(key, (chunks + i) * chunk, size)
                                           for i, (key, size) in enumerate(zip(keys, sizes))], target, exact=True)
    if not got:
        return [], 0
    count = found.tokens - chunks * chunk if len(got) == len(keys) else len(got) * chunk
    return [torch.cat(parts, 2)[:, :, :count] for parts in zip(*got)], count


def stored_bytes(kdn, model, tokens, edit) -> int:
    """Bytes a ``kvzip`` edit of ``tokens``'s full chunks occupies in the tiers (masks and rows, as
    stored: coded when a codec applies); the chunks found before the first missing one."""
    edit = parse_many(edit)[0]
    session = kdn.session(model)
    total = 0
    for key in session.prefix_keys(session.tokens(tokens)):
        address = edit.address(key)
        payload = kdn.sidecars.read(session, address)
        rows = kdn.stored_bytes(kvzip.rows_address(address, payload)) if payload is not None else 0
        if not rows:
            break
        total += kdn.stored_bytes(address) + rows
    return total
