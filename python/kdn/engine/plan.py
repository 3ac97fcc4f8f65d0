"""Delivery decisions: layer groups, how many chunks to stream (the rest recomputed from text) and
each layer group's level, from measured bandwidth and prefill speed. Pure functions and small
estimators, so that every decision is testable without a network."""

from __future__ import annotations

import dataclasses
import threading


def layer_groups(layers: int, group: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` covering ``layers`` in groups of ``group`` layers (the last may be shorter)."""
    return [(first, min(first + group, layers)) for first in range(0, layers, group)]


class Estimates:
    """What delivery has measured, shared by the requests of one KDN: link bandwidth (bytes/s) and
    round-trip time of the remote tier, and each model's forward time: seconds per token (from
    prefills of at least 32 tokens) plus a fixed cost per forward (from short ones, such as the
    question after a hit, where the layers' overhead dominates). Exponentially
    weighted (``alpha`` on the newest sample), so a link that changes speed is followed within a
    few samples; None until the first sample.

    Example:
        >>> e = Estimates(); e.observe_transfer(1_000_000, 0.01); e.bandwidth
        100000000.0
    """

    def __init__(self, alpha: float = 0.6):
        self.alpha = alpha
        self.bandwidth: float | None = None
        self.rtt: float | None = None
        self._prefill: dict[bytes, float] = {}
        self._fixed: dict[bytes, float] = {}
        self._decode: dict[str, float] = {}  # seconds per layer, per level
        self._lock = threading.Lock()

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.alpha * new + (1 - self.alpha) * old

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """One range read of ``nbytes`` that took ``seconds`` (round trip included)."""
        seconds = max(seconds, 1e-6)
        with self._lock:
            rtt = self.rtt or 0.0
            self.bandwidth = self._mix(self.bandwidth, nbytes / max(seconds - rtt, seconds / 2))

    def observe_rtt(self, seconds: float) -> None:
        with self._lock:
            self.rtt = self._mix(self.rtt, max(seconds, 0.0))

    def observe_decode(self, spec: str, seconds_per_layer: float) -> None:
        """Decoding and laying out one layer of a request's chunks at level ``spec`` took this long."""
        with self._lock:
            self._decode[spec] = self._mix(self._decode.get(spec), seconds_per_layer)

    def decode_seconds(self, spec: str, layers: int) -> float:
        """Estimated seconds to decode ``layers`` layers at level ``spec`` (0 before it was seen)."""
        return self._decode.get(spec, 0.0) * layers

    def observe_prefill(self, fingerprint: bytes, tokens: int, seconds: float) -> None:
        """A forward over ``tokens`` new tokens that took ``seconds``."""
        if seconds <= 0 or tokens <= 0:
            return
        with self._lock:
            if tokens < 32:
                self._fixed[fingerprint] = self._mix(self._fixed.get(fingerprint), seconds)
            else:
                per_token = max(seconds - self._fixed.get(fingerprint, 0.0), seconds / 2) / tokens
                self._prefill[fingerprint] = self._mix(self._prefill.get(fingerprint), per_token)

    def prefill_seconds(self, fingerprint: bytes, tokens: int) -> float | None:
        """Estimated seconds of a forward over ``tokens`` tokens of this model, or None (never measured)."""
        per_token = self._prefill.get(fingerprint)
        return None if per_token is None else self._fixed.get(fingerprint, 0.0) + per_token * tokens


@dataclasses.dataclass
class Request:
    """What a plan needs to know of one request. ``sizes[c][v][g]``: bytes of layer group g of
    remote chunk c at level v (None where that level is not stored); ``chunk_tokens[c]``: tokens
    each remote chunk adds to the hit; ``local_tokens``: the hit already on this machine;
    ``prompt_tokens``: the prompt's length; ``deadline``: seconds to first token from the start."""

    sizes: list
    chunk_tokens: list
    local_tokens: int
    prompt_tokens: int
    deadline: float | None


def lowest_bytes(sizes_of_chunk: list, groups: range) -> int:
    """Bytes of ``groups`` of one chunk at the smallest level it has."""
    return sum(min(s[g] for s in sizes_of_chunk if s is not None) for g in groups)


def streamed_ttft(transfer: float, compute: float, groups: int) -> float:
    """Estimated TTFT of a layer-wise request: transfer and compute overlap, one group of the
    shorter stage is not hidden."""
    return max(transfer, compute) + min(transfer, compute) / max(groups, 1)


def chunks_to_stream(req: Request, estimates: Estimates, fingerprint: bytes, groups: int) -> tuple[int, str]:
    """How many leading remote chunks to stream (the rest of the prompt is recomputed), and why.

    Without a deadline, or before the bandwidth or the prefill speed was ever measured, every
    chunk is streamed. Otherwise the most chunks whose estimated TTFT (at the smallest level)
    meets the deadline; if none does, the count with the lowest estimate, where 0 (recompute the
    remote part) also competes, so a hit is never planned slower than a prefill.
    """
    n = len(req.sizes)
    bandwidth = estimates.bandwidth
    if req.deadline is None or not bandwidth:
        return n, "no deadline" if req.deadline is None else "bandwidth not measured yet"
    if estimates.prefill_seconds(fingerprint, 1) is None:
        return n, "prefill speed not measured yet"
    rtt = estimates.rtt or 0.0
    best, best_ttft = 0, None
    for k in range(n, -1, -1):
        transfer = sum(lowest_bytes(req.sizes[c], range(groups)) for c in range(k)) / bandwidth + groups * rtt * (k > 0)
        compute = estimates.prefill_seconds(fingerprint,
                                            req.prompt_tokens - req.local_tokens - sum(req.chunk_tokens[:k]))
        ttft = streamed_ttft(transfer, compute, groups)
        if ttft <= req.deadline:
            return k, "meets the deadline" if k == n else f"{n - k} chunk(s) recomputed to meet the deadline"
        if best_ttft is None or ttft < best_ttft:
            best, best_ttft = k, ttft
    return best, "deadline out of reach: the fastest plan"


def level_for_group(sizes: list, group: int, groups: int, seconds_left: float | None, bandwidth: float | None,
                    decode: list | None = None) -> int:
    """The level (index into each chunk's levels, best first) for layer ``group`` of the remote
    chunks: the best level that, kept for the remaining groups, moves their bytes within
    ``seconds_left`` at ``bandwidth`` and (``decode[level]``: seconds per group, measured) decodes
    them in that time too (fetch and decode overlap); the smallest level if none does; level 0
    (exact) without a deadline. A chunk that lacks the level is served its nearest smaller one
    (:func:`level_of_chunk`)."""
    if seconds_left is None:
        return 0
    if not bandwidth:
        return _levels(sizes) - 1  # nothing measured yet: start small, measure, then climb
    left = groups - group
    for level in range(_levels(sizes)):
        need = sum(_size_at(chunk, level, g) for chunk in sizes for g in range(group, groups))
        if max(need / bandwidth, left * (decode[level] if decode else 0.0)) <= seconds_left:
            return level
    return _levels(sizes) - 1


def _levels(sizes: list) -> int:
    return max(len(chunk) for chunk in sizes)


def level_of_chunk(chunk_sizes: list, level: int) -> int:
    """The level a chunk is served at when ``level`` is asked: that one if stored, else the nearest
    smaller (later) one, else the nearest better one."""
    order = list(range(level, len(chunk_sizes))) + list(range(level - 1, -1, -1))
    return next(v for v in order if chunk_sizes[v] is not None)


def _size_at(chunk_sizes: list, level: int, group: int) -> int:
    return chunk_sizes[level_of_chunk(chunk_sizes, min(level, len(chunk_sizes) - 1))][group]
