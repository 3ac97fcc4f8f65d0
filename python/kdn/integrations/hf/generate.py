"""HF transformers integration: generate with kdn as the KV-cache provider, and a TTFT timer."""

from __future__ import annotations

import logging
import time

import torch
from transformers.generation.streamers import BaseStreamer

from kdn._core import InvalidInputError
from kdn.engine import Engine, Load, Retention
from kdn.engine.stream import DeliveryError
from kdn.integrations.hf import vouch
from kdn.integrations.hf.cache import load_cache
from kdn.layout import CACHE_ARG, cache_arg, cache_to_kv_list, full_cache, kv_list_to_cache, output_cache, prefill_cache

log = logging.getLogger("kdn")


class FirstTokenTimer(BaseStreamer):
    """A generate() streamer that records the time-to-first-token.

    Example:
        >>> timer = FirstTokenTimer()
        >>> out = model.generate(ids, streamer=timer, max_new_tokens=8)
        >>> timer.ttft > 0   # seconds from timer.start() (or construction) to the first new token
        True
    """

    def __init__(self):
        self.start()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.ttft: float | None = None
        self._calls = 0

    def put(self, value) -> None:
        self._calls += 1
        if self._calls == 2 and self.ttft is None:  # call 1 is the prompt, call 2 the first token
            self.ttft = time.perf_counter() - self.t0

    def end(self) -> None:
        pass


def _as_batch_one(model, input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise InvalidInputError(f"kdn generate handles batch size 1; got input_ids of shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise InvalidInputError("input_ids is empty")
    return ids.to(next(model.parameters()).device, dtype=torch.long)


def _rows_per_prompt(model, generate_kwargs) -> int:
    """How many rows ``model.generate`` expands one prompt into (beams, returned sequences)."""
    config = generate_kwargs.get("generation_config") or model.generation_config
    rows = []
    for name in ("num_beams", "num_return_sequences"):
        value = generate_kwargs.get(name, getattr(config, name, 1))
        value = 1 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"generate: {name} must be a positive integer, got {value!r}")
        rows.append(value)
    return max(rows)


def generate(engine: Engine, model, input_ids, **generate_kwargs):
    """Retrieve the prompt's stored prefix, let ``model.generate`` prefill only the rest, store the new KV.

    Args:
        engine: the :class:`kdn.engine.Engine` (a :class:`kdn.KDN`'s is ``KDN.engine``).
        model: an HF causal LM.
        input_ids: [n] or [1, n] token ids.
        **generate_kwargs: passed to ``model.generate`` (``past_key_values`` is kdn's to provide;
            an ``attention_mask``, if given, must be all ones), except ``edits``: edited caches this
            call accepts (:mod:`kdn.edits`, e.g. ``"kvzip:keep=0.3"``), served when stored (the exact
            cache otherwise); nothing computed over an edited cache is stored; and ``namespace``:
            the tenant this call reads and stores in (within ``KDNConfig.namespace``; the same
            string as a vLLM request's ``cache_salt`` shares KV with it, and nothing else does);
            ``retain``: seconds to keep the prompt's KV pinned in memory after this call (bounded
            by the operator's ``KDNConfig.retain_max_seconds`` and ``retain_fraction``: a request
            beyond the bound is an InvalidInputError before anything is computed); ``priority``:
            the prompt's place in its tenant's eviction order (a lower one leaves first,
            :class:`kdn.engine.Retention`); ``store=False``:
            an ephemeral request, served what is stored and storing nothing.

    Returns ``(output, stats)``: what ``model.generate`` returns (``sequences`` tensor, or the dict
    output when ``return_dict_in_generate=True``, which then also carries ``kdn_stats``) and
    ``stats = {"hit_tokens", "prompt_tokens"}``. Storing never raises: a failure is logged and
    generation's result is returned. (:meth:`kdn.KDN.generate` returns the output alone and keeps
    the stats per thread in ``KDN.last_generate``.) ``stats`` also has ``ttft_seconds`` (from the
    lookup to the end of the prompt's forward) and, for a layer-wise hit, ``delivery`` (levels,
    bytes, bandwidth, chunks streamed and recomputed). KV computed over lossy KV is not stored
    (:mod:`kdn.engine.served`). With ``KDNConfig.verify_fraction``, a sampled hit's last tokens are
    recomputed after the answer and compared with the stored KV (:mod:`kdn.engine.verify`).

    Example:
        >>> engine = kdn.KDN().engine
        >>> prompt = tokenizer(document + question, return_tensors="pt").input_ids
        >>> out, stats = generate(engine, model, prompt, max_new_tokens=8)   # a miss: prefilled, stored
        >>> out, stats = generate(engine, model, prompt, max_new_tokens=8)   # a hit
        >>> stats["hit_tokens"] == prompt.shape[1] - 1                      # the last token is computed
        True
    """
    ids = _as_batch_one(model, input_ids)
    given = {"past_key_values", "cache"} & set(generate_kwargs)
    if given:
        raise InvalidInputError(f"generate: {given.pop()} is provided by kdn; do not pass it")
    mask = generate_kwargs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise InvalidInputError("generate: attention_mask with padding is not supported (batch size 1, no padding)")
    want_dict = generate_kwargs.pop("return_dict_in_generate", False)
    rows = _rows_per_prompt(model, generate_kwargs)
    edits = generate_kwargs.pop("edits", None)
    namespace = generate_kwargs.pop("namespace", None)
    retain = Retention.asked(generate_kwargs.pop("retain", None), generate_kwargs.pop("priority", None))
    keep = generate_kwargs.pop("store", True)
    if not isinstance(keep, bool):
        raise InvalidInputError(f"generate: store must be True or False, got {keep!r}")
    session = engine.session(model, namespace)
    if not vouch.served(model, session.layout, "KDN.generate"):  # a reading kdn cannot vouch for: the model alone
        generate_kwargs.update(cache_arg(full_cache(model)))
        out = model.generate(ids, return_dict_in_generate=True, use_cache=True, **generate_kwargs)
        return _returned(out, {"hit_tokens": 0, "prompt_tokens": int(ids.shape[1]), "refused": True}, want_dict)
    started = time.perf_counter()
    if session.layout.recurrent:  # a hybrid model: its state kept at chunk boundaries
        from kdn.integrations.hf import hybrid

        if edits or retain or rows > 1:
            hybrid.refuse(session.layout, "generate with edits=, retain=, priority=, beams or several sequences")
        return _returned(*hybrid.generate(engine, session, model, ids, keep, started, **generate_kwargs), want_dict)
    if retain:  # refused before anything is computed, not after
        if not keep:
            raise InvalidInputError("generate: retain= and priority= keep what a request stores; "
                                    "with store=False nothing is")
        engine.check_retention(session, ids.shape[1], retain)
    cache, load = load_cache(engine, model, session.tokens(ids[0]), ids.shape[1] - 1, edits, started, namespace)
    hit, stream = load.hit, load.stream
    if cache is not None:
        if rows > 1:  # beams / several sequences: generate expands the prompt, so the cache too
            cache.batch_repeat_interleave(rows)
        generate_kwargs.update(cache_arg(cache))
    else:  # a model with sliding windows keeps its whole prompt, to be stored
        generate_kwargs.update(cache_arg(full_cache(model)))
    first_forward: list = []
    hook = model.register_forward_hook(lambda *_: first_forward.append(time.perf_counter()))
    try:
        if load.bias is not None:
            from kdn.edits import steer

            with steer.applied(model, load.bias):
                out = model.generate(ids, return_dict_in_generate=True, use_cache=True, **generate_kwargs)
        else:
            out = model.generate(ids, return_dict_in_generate=True, use_cache=True, **generate_kwargs)
    except DeliveryError as exc:  # the link failed mid-stream: recompute, the answer is not lost
        log.warning("kdn: delivering the stored KV failed (%s); the prompt is recomputed", exc)
        load.finish()
        generate_kwargs.pop(CACHE_ARG, None)
        generate_kwargs.update(cache_arg(full_cache(model)))
        hit, stream, load, first_forward[:] = 0, None, Load(), []
        started = time.perf_counter()
        out = model.generate(ids, return_dict_in_generate=True, use_cache=True, **generate_kwargs)
    finally:
        hook.remove()
    stats = {"hit_tokens": hit, "prompt_tokens": int(ids.shape[1])}
    if load.edit:
        stats["edit"] = load.edit
    if first_forward:
        stats["ttft_seconds"] = first_forward[0] - started
        if stream is None:  # a plain prefill of the rest: it teaches delivery this model's speed
            engine.estimates.observe_prefill(session.fingerprint, int(ids.shape[1]) - hit, first_forward[0] - started)
    record = load.finish()  # every layer the forward waited for arrived: not failed
    if stream is not None:
        stats["delivery"] = stream.stats
    try:
        final = output_cache(out)
        if final is not None and rows == 1 and hit:
            verdict = _verify_hit(engine, session, model, ids, hit, cache_to_kv_list(final), record.lossy)
            record.suspect = verdict is False
        if final is not None and keep and rows == 1:
            n_kv = final.get_seq_length()
            engine.save(session, session.tokens(out.sequences[0, :n_kv]), [t.cpu() for t in cache_to_kv_list(final)],
                        record)
        elif final is not None and keep:  # rows diverge after the prompt (and beams reorder): store the prompt
            engine.save(session, session.tokens(ids[0]), [t[:1].cpu() for t in cache_to_kv_list(final)], record)
        if retain and final is not None:
            stats["retained_chunks"] = engine.retain(session, ids[0], retain)
    except Exception as exc:  # storing is best effort; the answer is already computed
        log.warning("kdn: storing the generated KV failed (%s); the result is returned unchanged", exc)
    return _returned(out, stats, want_dict)


def _returned(out, stats: dict, want_dict: bool):
    """What :func:`generate` returns: ``(out with kdn_stats, stats)`` or ``(sequences, stats)``."""
    if want_dict:
        out["kdn_stats"] = stats
        return out, stats
    return out.sequences, stats


@torch.inference_mode()
def _verify_hit(engine: Engine, session, model, ids: torch.Tensor, hit: int, kv: list[torch.Tensor],
                lossy: bool) -> bool | None:
    """If this hit is sampled (``KDNConfig.verify_fraction``), recompute its last tokens over the
    served prefix and let the engine judge them against the served rows (``kv``: the generated
    cache, whose first ``hit`` tokens are what kdn served); on a mismatch the engine drops the
    chunks that differ from a full recompute. False when the hit failed, None when not checked."""
    span = engine.sample_check(hit, lossy)
    if not span:
        return None
    start = hit - span
    prefix = kv_list_to_cache(model, [t[:, :, :start] for t in kv]) if start else None
    out = model(ids[:, start:hit], **cache_arg(prefix), use_cache=True, logits_to_keep=1)
    recomputed = [t[:, :, start:hit] for t in cache_to_kv_list(output_cache(out))]
    return engine.verify(session, session.tokens(ids[0]), (start, hit), recomputed, lossy, served=kv,
                         reference=lambda: cache_to_kv_list(prefill_cache(model, ids[:, :hit])))
