"""A token-addressed prompt served by blending: cut at its passages into pieces, each keyed as a
segment (:meth:`kdn.engine.ModelSession.segment_key`, as ``KDN.store_segments`` keys them), the
blended span's KV joined from the stored pieces, re-rotated and selectively recomputed by the
engine's recompute (:mod:`kdn.engine.recompute`) through the serving engine's own layers; and the
pieces it lacked computed on their own and stored for the next prompt. Face-free: a face names the
passages, hands its model's layers (a :class:`kdn.engine.recompute.LayerStack` that can also
``rotate`` keys) and lays the result into its own blocks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from kdn._core import InvalidInputError
from kdn.engine.core import Engine
from kdn.engine.recompute import SELECTIONS, selective_prefill
from kdn.engine.session import ModelSession
from kdn.engine.targets import HFTarget

DEFAULT_RATIO = 0.15


@dataclasses.dataclass(frozen=True)
class Piece:
    """Prompt positions [start, end), computed behind ``behind`` (the prompt's first piece behind
    nothing: it is a true prefix; every other behind BOS, at positions 1, ...) under ``key``."""

    start: int
    end: int
    behind: tuple
    key: bytes


@dataclasses.dataclass
class Blend:
    """A prompt's pieces, how many leading ones kdn held at the lookup (``held``: the blended span
    is ``[0, end)``), and how to recompute (``ratio`` of the span's tokens, by ``selection``)."""

    pieces: list
    held: int = 0
    ratio: float = DEFAULT_RATIO
    selection: str = "kv"

    @property
    def end(self) -> int:
        return self.pieces[self.held - 1].end if self.held else 0


def check_passages(passages, n: int) -> list[tuple[int, int]]:
    """``passages`` (``[[start, end], ...]`` token spans of a prompt of ``n`` tokens) checked: in
    order, not overlapping, not empty, inside the prompt. Raises InvalidInputError naming the fault."""
    if not isinstance(passages, (list, tuple)) or not passages:
        raise InvalidInputError(f"passages: a non-empty list of [start, end] token spans, got {passages!r:.80}")
    spans, last = [], 0
    for span in passages:
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)):
            raise InvalidInputError(f"passages: each a [start, end] pair of token positions, got {span!r:.80}")
        start, end = span
        if not last <= start < end <= n:
            raise InvalidInputError(f"passages: [{start}, {end}) must be non-empty, in order, not overlapping and "
                                    f"within the prompt's {n} tokens")
        spans.append((start, end))
        last = end
    return spans


def check_ratio(ratio, selection: str = "kv") -> tuple[float, str]:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise InvalidInputError(f"recompute_ratio must be a number within [0, 1], got {ratio!r:.40}")
    if selection not in SELECTIONS:
        raise InvalidInputError(f"selection {selection!r:.40}; choose one of {', '.join(SELECTIONS)}")
    return float(ratio), selection


def cut(session: ModelSession, tokens: np.ndarray, spans: list[tuple[int, int]], bos: list[int]) -> list[Piece]:
    """The pieces of a prompt up to its last passage's end: cut at every passage's start and end
    (the text between two passages is a piece of its own), each keyed behind what it is computed
    behind (the first behind nothing, the others behind ``bos``)."""
    bounds = sorted({0, *(b for span in spans for b in span)})
    behind = np.asarray(bos, dtype=np.uint32)
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        before = np.zeros(0, np.uint32) if start == 0 else behind
        pieces.append(Piece(start, end, tuple(int(t) for t in before),
                            session.segment_key(before, tokens[start:end])))
    return pieces


def candidates(pieces: list[Piece], n: int) -> list[Piece]:
    """The pieces a prompt of ``n`` tokens may be blended from: those ending before its last token
    (the engine computes that one); they lead the prompt."""
    return [p for p in pieces if p.end < n]


def leading_held(engine: Engine, keys: list[bytes]) -> int:
    """How many of ``keys``, from the first, some tier of ``engine`` holds (reads no KV)."""
    held = 0
    for key in keys:
        if not engine.holds(key):
            break
        held += 1
    return held


def plan(engine: Engine, session: ModelSession, tokens: np.ndarray, spans, bos: list[int],
         ratio: float = DEFAULT_RATIO, selection: str = "kv") -> Blend:
    """The blend of a prompt: its pieces and how many leading ones some tier holds (reads no KV),
    the span ending before the prompt's last token (the engine computes that one)."""
    pieces = cut(session, tokens, spans, bos)
    return Blend(pieces, leading_held(engine, [p.key for p in candidates(pieces, len(tokens))]), ratio, selection)


def blended(engine: Engine, session: ModelSession, stack, blend: Blend, tokens: np.ndarray,
            device) -> tuple[int, list[torch.Tensor] | None, int]:
    """``(end, kv, recomputed)``: the KV of prompt positions [0, end) (per-layer ``[1, kv_heads, end,
    head_dim]``) joined from the stored pieces (re-rotated by ``stack.rotate`` to where each sits)
    and recomputed at ``blend.ratio`` (0: naive reuse, nothing recomputed; ``recomputed``: the
    tokens computed again, summed over layers); ``end`` stops before the first piece no longer
    stored (0, None, 0: the first)."""
    wanted = blend.pieces[:blend.held]
    found = engine.segments.read_many(session, [(p.key, len(p.behind), p.end - p.start) for p in wanted],
                                      HFTarget(device))
    if not found:
        return 0, None, 0
    pieces = wanted[:len(found)]
    end = pieces[-1].end
    kv = []
    for layer in range(2 * session.layout.layers):
        parts = [stack.rotate(got[layer], p.start - len(p.behind)) if layer % 2 == 0 else got[layer]
                 for p, got in zip(pieces, found)]
        kv.append(torch.cat(parts, dim=2).contiguous())
    if blend.ratio == 0:
        return end, kv, 0
    ids = torch.as_tensor(tokens[:end].astype(np.int64), device=device)[None]
    spans = [(p.start, p.end) for p in pieces]
    _, stats = selective_prefill(stack, ids, kv, end, blend.ratio, selection=blend.selection, segments=spans)
    return end, kv, sum(stats["recomputed_per_layer"])


def store_missing(engine: Engine, session: ModelSession, stack, blend: Blend, tokens: np.ndarray, device) -> int:
    """Compute every piece of the prompt no tier holds on its own (behind what it is keyed behind,
    through ``stack``: the serving engine's weights) and store it as a segment; how many were stored."""
    stored = 0
    layout = session.layout
    for piece in blend.pieces:
        if engine.holds(piece.key):
            continue
        ids = np.concatenate([np.asarray(piece.behind, np.int64), tokens[piece.start:piece.end].astype(np.int64)])
        n = len(ids)
        kv = [torch.zeros((1, layout.kv_heads, n, layout.head_dim), dtype=layout.torch_dtype, device=device)
              for _ in range(2 * layout.layers)]
        selective_prefill(stack, torch.as_tensor(ids, device=device)[None], kv, 0, 1.0)
        stored += engine.segments.write(session, piece.key, [t.cpu() for t in kv], len(piece.behind),
                                        piece.end - piece.start)
    return stored
