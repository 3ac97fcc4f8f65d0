"""Verified reuse: a sampled fraction of hits has its last served tokens recomputed and compared with
what kdn stores; a mismatch is counted, logged once with the chunk keys, and its chunks dropped.

How a hit is checked (``KDNConfig.verify_fraction``; every face does the same):

1. The last ``VERIFY_TOKENS`` tokens of the hit are recomputed by the model over the served prefix
   before them (HF: one small extra forward after ``generate``; vLLM: they are held back from the
   hit, so the engine computes them in the prefill it runs anyway).
2. Their recomputed K and V are compared with the stored rows, plane by plane (a layer's K or V):
   the largest ``|recomputed - stored| / max|stored|`` must stay within the tolerance of the served
   fidelity (exact: by dtype, :data:`EXACT_TOLERANCE`). Attention is causal, so the last tokens'
   KV at every layer above the first depends on every served token before them: a wrong chunk
   anywhere in the prefix changes it (measured: a chunk of another prompt's KV moves it by 2-65%,
   the exact recompute by ~1e-6 in fp32, ~2e-2 in bf16).
3. A mismatch: HF recomputes the whole prefix to find exactly which chunks differ and drops those;
   vLLM (which cannot run the model on the side) drops every chunk of the hit, and the next request
   for the prompt recomputes and stores it again. Nothing of a suspect request is stored.

Lossy hits are not verified (a codec's error and a wrong chunk are not yet separated by one
tolerance); that is logged once.
"""

from __future__ import annotations

import logging
import random
import threading

import torch

log = logging.getLogger("kdn")

VERIFY_TOKENS = 16  # tokens recomputed per verified hit
# largest relative difference per plane between an exact stored row and its recomputation
EXACT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 6e-2, torch.bfloat16: 6e-2}


def plane_error(served: list[torch.Tensor], recomputed: list[torch.Tensor]) -> float:
    """The largest ``max|recomputed - served| / max|served|`` over planes (matching lists of
    ``[..., tokens, head_dim]`` tensors holding the same tokens)."""
    worst = 0.0
    for a, b in zip(served, recomputed):
        a, b = a.float(), b.float()
        scale = float(a.abs().max()) or 1.0
        worst = max(worst, float((a - b).abs().max()) / scale)
    return worst


class Verifier:
    """Samples hits for verification and keeps its counters (``checks``, ``mismatches``,
    ``dropped_chunks``, ``skipped_lossy``). Thread-safe."""

    def __init__(self, fraction: float, seed: int | None = None):
        self.fraction = fraction
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.counters = {"checks": 0, "mismatches": 0, "dropped_chunks": 0, "skipped_lossy": 0}

    def sample(self, hit: int) -> int:
        """How many of a hit's last tokens to recompute and compare (0: this hit is not checked)."""
        if hit <= 0 or self.fraction <= 0:
            return 0
        with self._lock:
            chosen = self.fraction >= 1 or self._rng.random() < self.fraction
        return min(VERIFY_TOKENS, hit) if chosen else 0

    def tolerance(self, dtype: torch.dtype, lossy: bool) -> float | None:
        """The largest plane error an honest hit shows, or None when this hit cannot be judged."""
        if lossy:
            self._once("lossy", "kdn: verification skips hits served from lossy codings (their coding error "
                       "and a wrong chunk are not separated by one tolerance yet)")
            self.count(skipped_lossy=1)
            return None
        return EXACT_TOLERANCE.get(dtype, 6e-2)

    def judge(self, error: float, tolerance: float) -> bool:
        """Count one check; True if it passed."""
        ok = error <= tolerance
        self.count(checks=1, mismatches=0 if ok else 1)
        return ok

    def dropped(self, keys: list[bytes], why: str) -> None:
        """Report chunks dropped after a mismatch (logged once per first key)."""
        if not keys:
            self._once(why, "kdn: a verified hit's last tokens differed (%s), but no stored chunk differs from "
                       "a full recompute; nothing dropped", why)
            return
        self.count(dropped_chunks=len(keys))
        self._once(keys[0].hex() if keys else why, "kdn: served KV failed verification (%s); dropped %d chunk(s) "
                   "from every tier: %s", why, len(keys), ", ".join(k.hex() for k in keys))

    def count(self, **deltas) -> None:
        with self._lock:
            for name, value in deltas.items():
                self.counters[name] += value

    def stats(self) -> dict:
        with self._lock:
            return {"fraction": self.fraction, **self.counters}

    def _once(self, tag: str, message: str, *args) -> None:
        with self._lock:
            if tag in self._logged:
                return
            self._logged.add(tag)
        log.warning(message, *args)
