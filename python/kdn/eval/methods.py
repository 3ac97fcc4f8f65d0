"""The methods an evaluation compares, all through the public KDN API, and the hook to add more.

``full`` (the whole prompt prefilled: the baseline), ``reuse`` (the context's KV stored once,
then served from kdn so only the question is prefilled), ``naive`` and ``blend@<ratio>[:<selection>]`` (segments
cached separately, joined by :meth:`KDN.blend`), ``reuse+<codec>`` (reuse with the context's KV
held in a codec, e.g. ``reuse+int4``, ``reuse+cachegen:level=1``: see :mod:`kdn.codecs`). A
capability plugs in with :func:`register_method`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from kdn import codecs
from kdn._core import InvalidInputError
from kdn.blend.recompute import SELECTIONS
from kdn.config import KDNConfig
from kdn.integrations.hf import KDN, FirstTokenTimer
from kdn.layout import cache_arg, output_cache, prefill_cache


@dataclasses.dataclass
class Encoded:
    """A tokenized sample: ``ids`` = ``context_ids`` (template head + segments) + question ids."""

    ids: torch.Tensor  # [1, n]
    context_tokens: int
    segment_spans: list[tuple[int, int]]  # [start, end) of each segment inside the context
    truncated: bool


@dataclasses.dataclass
class Answer:
    tokens: list[int]
    ttft_s: float
    prefill_tokens: int  # tokens the model computed for this request (compute per request)
    hit_tokens: int = 0
    inject_s: float = 0.0  # one-time cost of putting the context's knowledge into kdn
    miss_overhead: float | None = None  # what storing adds to the context's prefill (a miss's extra cost)
    stored_bytes: int = 0


class Method:
    """Answers one encoded sample; ``available``/``reason`` say whether it can run here."""

    name = "method"
    available, reason = True, ""

    def answer(self, model, enc: Encoded, max_new_tokens: int) -> Answer:
        raise NotImplementedError


def _generate(model, ids, max_new_tokens, past_key_values=None):
    """Greedy answer tokens, the first-token timer, and the cache generate ended with."""
    timer = FirstTokenTimer()
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, streamer=timer,
                             attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                             **cache_arg(past_key_values))
    return out.sequences[0, ids.shape[1]:].tolist(), timer, output_cache(out)


@dataclasses.dataclass
class _ContextKV:
    """The KV of one sample's context, computed once and read by every reuse method of that sample."""

    model: object
    context: torch.Tensor
    kv: object
    prefill_s: float

    def matches(self, model, context) -> bool:
        return self.model is model and torch.equal(self.context, context)


_context_kv: list[_ContextKV] = []  # the current sample's, at most one


def _share_context_kv(entry: _ContextKV) -> None:
    _context_kv[:] = [entry]


class Full(Method):
    """The whole prompt prefilled. Its cache, cut to the context, is what a miss would store: the
    reuse methods of the same sample store that instead of prefilling the context again (causal
    attention: a context row does not depend on the question after it)."""

    name = "full"

    def answer(self, model, enc, max_new_tokens):
        tokens, timer, cache = _generate(model, enc.ids, max_new_tokens)
        if hasattr(cache, "crop"):
            cache.crop(enc.context_tokens - cache.get_seq_length())  # drop the question and the answer
            _share_context_kv(_ContextKV(model, enc.ids[:, : enc.context_tokens], cache, timer.ttft))
        return Answer(tokens, timer.ttft, prefill_tokens=enc.ids.shape[1])


class Reuse(Method):
    """Prefix reuse: the context is prefilled and stored once (timed as injection), then each
    request retrieves it from kdn and prefills only what is not stored (question + partial chunk)."""

    name = "reuse"

    def __init__(self, config: KDNConfig, name: str = "reuse"):
        self.config, self.name = config, name

    def answer(self, model, enc, max_new_tokens):
        kdn = KDN(self.config)
        context = enc.ids[:, : enc.context_tokens]
        if _context_kv and _context_kv[0].matches(model, context):
            kv, prefill_s = _context_kv[0].kv, _context_kv[0].prefill_s
        else:
            _context_kv.clear()
            t0 = time.perf_counter()
            with torch.inference_mode():
                kv = prefill_cache(model, context)
            prefill_s = time.perf_counter() - t0
            _share_context_kv(_ContextKV(model, context, kv, prefill_s))
        t0 = time.perf_counter()
        kdn.store(model, context, kv)
        kdn.flush()
        store_s = time.perf_counter() - t0
        inject_s = prefill_s + store_s
        stored = sum(s.get("used_bytes", 0) for s in kdn.stats().values())
        timer_start = time.perf_counter()
        cache, hit = kdn.retrieve(model, enc.ids, limit=enc.ids.shape[1] - 1)
        tokens, timer, _ = _generate(model, enc.ids, max_new_tokens, cache)
        ttft = timer.ttft + (timer.t0 - timer_start)  # the retrieve is part of the response delay
        return Answer(tokens, ttft, prefill_tokens=enc.ids.shape[1] - hit, hit_tokens=hit, inject_s=inject_s,
                      stored_bytes=stored, miss_overhead=store_s / prefill_s)


class Blend(Method):
    """Segments cached separately (:meth:`KDN.store_segments`, timed as injection), joined at query
    time by :meth:`KDN.blend`: ``naive`` (re-rotate and concatenate) or ``blend@<ratio>`` (CacheBlend
    selective recompute). Compute per request = tokens recomputed (averaged over layers) + the rest."""

    def __init__(self, name: str, config: KDNConfig, mode: str, ratio: float, selection: str = "kv"):
        self.name, self.config, self.mode, self.ratio, self.selection = name, config, mode, ratio, selection

    def answer(self, model, enc, max_new_tokens):
        ids = enc.ids[0].tolist()
        prefix = ids[: enc.segment_spans[0][0]] if enc.segment_spans else ids[: enc.context_tokens]
        segments = [ids[a:b] for a, b in enc.segment_spans if b > a]
        query = ids[enc.context_tokens:]
        key = (model, self.config, tuple(prefix), tuple(map(tuple, segments)))
        if _segments_kdn and _segments_kdn[0][0] == key:
            kdn, inject_s, stored = _segments_kdn[0][1:]
        else:  # the segments are stored once per sample; every blend method of it reads them
            _segments_kdn.clear()
            kdn = KDN(self.config)
            t0 = time.perf_counter()
            kdn.store_segments(model, segments, prefix=prefix)
            inject_s = time.perf_counter() - t0
            stored = sum(s.get("used_bytes", 0) for s in kdn.stats().values())
            _segments_kdn.append((key, kdn, inject_s, stored))
        start = time.perf_counter()
        cache, stats = kdn.blend(model, segments, query, recompute_ratio=self.ratio, prefix=prefix, mode=self.mode,
                                 selection=self.selection)
        tokens, timer, _ = _generate(model, enc.ids, max_new_tokens, cache)
        ttft = timer.ttft + (timer.t0 - start)
        per_layer = stats.get("recomputed_per_layer")
        recomputed = sum(per_layer) / len(per_layer) if per_layer else 0.0
        rest = enc.ids.shape[1] - stats["tokens"]
        return Answer(tokens, ttft, prefill_tokens=round(recomputed + rest), hit_tokens=stats["context_tokens"],
                      inject_s=inject_s, stored_bytes=stored)


_segments_kdn: list[tuple] = []  # ((model, config, prefix, segments), kdn, inject_s, stored) of the current sample


class Unavailable(Method):
    available = False

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason


_FACTORIES: dict[str, Callable[[str, KDNConfig], Method]] = {}


def register_method(prefix: str, factory: Callable[[str, KDNConfig], Method]) -> None:
    """Make ``prefix`` (e.g. ``"blend"`` for ``blend@0.15``) resolve to ``factory(name, config)``."""
    _FACTORIES[prefix] = factory


def resolve_method(name: str, config: KDNConfig) -> Method:
    """The method for a name such as ``full``, ``reuse``, ``reuse+int8``, ``naive``, ``blend@0.15``."""
    base = name.split("@", 1)[0].split("+", 1)[0]
    if base in _FACTORIES:
        return _FACTORIES[base](name, config)
    if name == "full":
        return Full()
    if name == "reuse":
        return Reuse(config)
    if base == "reuse":  # reuse+<codec>: the stored chunks are held (and decoded) in that codec
        spec = name.split("+", 1)[1]
        try:
            codec = codecs.parse(spec)
        except InvalidInputError as e:
            raise ValueError(f"method {name!r}: {e}") from None
        return Reuse(dataclasses.replace(config, memory_codec=codec.spec), name)
    if name == "naive":
        return Blend(name, config, "naive", 0.0)
    if base == "blend":  # blend@<ratio>[:<selection>]
        rest, _, selection = name.partition(":")
        selection = selection or "kv"
        if selection not in SELECTIONS:
            raise ValueError(f"method {name!r}: selection {selection!r}; choose one of {', '.join(SELECTIONS)}")
        try:
            ratio = float(rest.split("@", 1)[1]) if "@" in rest else 0.15
        except ValueError:
            raise ValueError(f"method {name!r}: the recompute ratio after '@' must be a number") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"method {name!r}: the recompute ratio must be within [0, 1]")
        return Blend(name, config, "blend", ratio, selection)
    raise ValueError(f"unknown method {name!r}; known: full, reuse, reuse+<codec>, naive, "
                     f"blend@<ratio>[:{'|'.join(SELECTIONS)}]")
