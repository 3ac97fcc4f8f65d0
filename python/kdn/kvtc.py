"""Calibration of the ``kvtc`` transform codec: per-model PCA bases and bit allocations, fit once.

The codec (``"kvtc"``, ``"kvtc:ratio=12"``; C++ in ``csrc/codec/kvtc.cpp``) projects each token's
keys or values of a layer onto a PCA basis of that plane, quantizes each component with its own
step and entropy-codes the integers. What it needs from the model is fit here, on contexts of
your choice:

1. the KV of every calibration context (keys turned back to their pre-RoPE form by default:
   rotation mixes channel pairs at every position, which spreads the variance PCA should find);
2. per plane (layer, K or V): mean, covariance, eigenvectors sorted by variance;
3. per component and candidate step (``sigma * 2^(-j/2)``, or not coded): the measured rate
   (empirical entropy of the quantized calibration data) and distortion (its mean squared error);
4. a dynamic program per plane: the least distortion at every total rate (in quarter bits per
   token); then one Lagrange multiplier across planes meets each offered ratio's budget,
   distortions weighted per plane (relative to the plane's variance; keys ``key_weight`` times).

The result is a versioned byte string (:data:`VERSION`) that is stored as a blob of its own under
:func:`calibration_key` (the model's fingerprint): :meth:`kdn.KDN.calibrate` fits, stores it in
every tier and loads it; a KDN that meets the model later loads it from any tier. A chunk coded
under a calibration names it; if that calibration cannot be found, the chunk is a miss.

Example:
    >>> from kdn import codecs, kvtc
    >>> cal = kvtc.calibrate(model, [tokenizer(document)["input_ids"]], progress=False)
    >>> calibration_id = kvtc.load(cal)         # or KDN.calibrate(model, contexts)
    >>> cache = kdn.KDN(kdn.KDNConfig(chunk_size=16))
    >>> stored = cache.store(model, ids, model(ids, use_cache=True).past_key_values)
    >>> blob = cache.memory.get(cache.chunk_keys(model, ids)[1])   # a chunk past the exact sinks
    >>> coded = codecs.encode(blob, "kvtc:ratio=8")
    >>> codecs.decode(coded).shape == codecs.decode(blob).shape, len(coded) < len(blob) / 8   # blob: fp32
    (True, True)
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from kdn import _core
from kdn._core import InvalidInputError
from kdn.keys import model_fingerprint

VERSION = 1
RATIOS = (4, 5, 6, 8, 10, 12, 16, 20, 24)  # compression vs fp16 each calibration offers
STEP_EXPONENTS = np.arange(-4, 11)          # candidate steps sigma * 2^(-j/2): 4 sigma down to sigma / 32
UNITS = 16                                  # rate units per bit in the dynamic program
MAX_BITS = 6                                # most bits per value the program considers
KEY_WEIGHT = 0.25                           # keys' distortion weight against values' (measured: bench_codecs)
SINK = 4                                    # positions below this are not fit (kept exact by the codec)


def calibration_key(fingerprint: bytes) -> bytes:
    """Where a model's calibration is filed in the tiers (versioned)."""
    return _core.blake3(b"kdn/kvtc-calibration/%d" % VERSION + bytes(fingerprint), 16)


def load(calibration: bytes) -> bytes:
    """Load calibration bytes into this process (encoders and decoders find it); returns its id."""
    return _core.kvtc_load(calibration)



@torch.inference_mode()
def calibrate(model, contexts, prerope: bool = True, key_weight: float = KEY_WEIGHT, ratios=RATIOS,
              progress: bool = True, per_head: bool = False) -> bytes:
    """Fit a calibration of ``model`` on ``contexts`` (lists of token ids; a few thousand tokens in
    all is enough for PCA over a plane's channels). Returns its bytes (see :func:`load`).
    ``per_head``: one basis per KV head (see :func:`fit`), what pruned (``kvzip``) deposits need. An MLA
    model's latent vector is fit as stored (``prerope`` does not apply: its RoPE key is a part of it)."""
    from kdn.layout import cache_to_kv_list, layout_of, prefill_cache
    from kdn.rope import inv_freq as model_inv_freq

    contexts = [list(map(int, c)) for c in contexts]
    if not contexts or any(len(c) <= SINK for c in contexts):
        raise InvalidInputError(f"calibrate: give contexts of more than {SINK} tokens each")
    layout = layout_of(model)
    prerope = prerope and not layout.latent  # an MLA vector is fit as stored: RoPE is only on its last values
    inv_freq = model_inv_freq(model).double() if prerope else None
    samples: list[list[np.ndarray]] = [[] for _ in range(2 * layout.layers)]
    device = next(model.parameters()).device
    for ids in _progress(contexts, progress, "kvtc: reading calibration contexts"):
        for p, t in enumerate(cache_to_kv_list(prefill_cache(model, torch.tensor([ids], device=device)))):
            rows = t[0].permute(1, 0, 2).double().cpu()  # [tokens, heads, head_dim]
            if p % 2 == 0 and prerope:
                rows = _unrotate(rows, inv_freq)
            samples[p].append(rows[SINK:].reshape(rows.shape[0] - SINK, -1).numpy())
    return fit([np.concatenate(s) for s in samples], model_fingerprint(model), layout.head_dim, inv_freq,
               key_weight, ratios, progress, per_head)


def fit(planes: list[np.ndarray], fingerprint: bytes, head_dim: int, inv_freq=None, key_weight: float = KEY_WEIGHT,
        ratios=RATIOS, progress: bool = False, per_head: bool = False) -> bytes:
    """A calibration from sample rows of every plane (``2 * layers`` arrays ``[rows, kv_heads *
    head_dim]``, K then V per layer; keys pre-RoPE when ``inv_freq`` is given, which the codec then
    uses to turn keys back and forth). What :func:`calibrate` does after reading the model's KV.

    ``per_head``: a PCA per KV head (block-diagonal bases: each component lives in one head's
    channels), so each (token, head) row codes on its own and a head row that is all zero (a token
    pruned for that head) costs one bit. ~35% more error than joint bases on unpruned KV (SmolLM2,
    ratio 8: 0.14 vs 0.10); on pruned KV the joint bases break (0.50) and these do not."""
    ratios = tuple(int(r) for r in ratios)
    if not ratios or not all(2 <= r <= 255 for r in ratios):
        raise InvalidInputError("kvtc: ratios must be in [2, 255]")
    if len(planes) % 2 or not planes or any(p.ndim != 2 or p.shape[1] != planes[0].shape[1] for p in planes):
        raise InvalidInputError("kvtc: give 2 * layers sample arrays [rows, channels] of one width")
    channels = planes[0].shape[1]
    if head_dim <= 0 or head_dim % 2 or channels % head_dim or min(len(p) for p in planes) < 2:
        raise InvalidInputError("kvtc: channels must be a multiple of an even head_dim, with 2+ rows per plane")
    fit_one = (lambda x: _fit_heads(x, head_dim)) if per_head else _fit_plane
    fitted = [fit_one(np.asarray(x, np.float64)) for x in _progress(planes, progress, "kvtc: fitting planes")]
    weights = [(key_weight if p % 2 == 0 else 1.0) / max(plane["variance"], 1e-30) for p, plane in enumerate(fitted)]
    curves = [_plane_curve(p) for p in _progress(fitted, progress, "kvtc: allocating bits")]
    steps = {ratio: _allocate(fitted, curves, weights, channels * 16 * UNITS / ratio) for ratio in ratios}
    freq = np.zeros(head_dim // 2) if inv_freq is None else np.asarray(inv_freq, np.float64)
    header = struct.pack("<4sI16s6I", b"KVTC", VERSION, bytes(fingerprint), len(planes) // 2, channels, head_dim,
                         channels, len(ratios), int(inv_freq is not None) | (4 if per_head else 0))
    parts = [header, freq.astype("<f4").tobytes(), np.asarray(ratios, "<u4").tobytes()]
    for p, plane in enumerate(fitted):
        parts += [plane["mean"].astype("<f4").tobytes(), plane["basis"].astype("<f4").tobytes(),
                  np.stack([steps[r][p] for r in ratios]).astype("<f4").tobytes()]
    return b"".join(parts)


def _unrotate(rows: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [tokens, heads, head_dim] (rotate-half RoPE at positions 0..) turned back to pre-RoPE."""
    angle = torch.arange(rows.shape[0], dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = angle.cos().float().double()[:, None], angle.sin().float().double()[:, None]
    a, b = rows.chunk(2, dim=-1)
    return torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)


def _fit_plane(x: np.ndarray) -> dict:
    """PCA of a plane's rows, and each component's (rate, distortion) at every candidate step."""
    mean = x.mean(0)
    centered = x - mean
    eigval, eigvec = np.linalg.eigh(centered.T @ centered / len(x))
    order = np.argsort(eigval)[::-1]
    basis = eigvec[:, order].T  # [components, channels]
    z = centered @ basis.T
    sigma = np.maximum(z.std(0), 1e-12)
    rates, dists, step_values = [], [], []
    for j in STEP_EXPONENTS:
        step = sigma * 2.0 ** (-j / 2)
        q = np.clip(np.rint(z / step), -127, 127)
        dists.append(((z - q * step) ** 2).mean(0))
        rates.append(_entropy_bits(q.astype(np.int64) + 127))
        step_values.append(step)
    # option 0: not coded (rate 0, distortion = the component's power)
    return {"mean": mean, "basis": basis, "variance": float((z ** 2).mean(0).sum()),
            "rate": np.vstack([np.zeros(len(sigma)), rates]).T,           # [components, options] bits per value
            "dist": np.vstack([(z ** 2).mean(0), dists]).T,
            "step": np.vstack([np.zeros(len(sigma)), step_values]).T}


def _fit_heads(x: np.ndarray, head_dim: int) -> dict:
    """:func:`_fit_plane` of each KV head's channels, as one plane with a block-diagonal basis."""
    heads = [_fit_plane(x[:, h:h + head_dim]) for h in range(0, x.shape[1], head_dim)]
    basis = np.zeros((x.shape[1], x.shape[1]))
    for i, head in enumerate(heads):
        basis[i * head_dim:(i + 1) * head_dim, i * head_dim:(i + 1) * head_dim] = head["basis"]
    return {"mean": np.concatenate([h["mean"] for h in heads]), "basis": basis,
            "variance": sum(h["variance"] for h in heads),
            **{k: np.concatenate([h[k] for h in heads]) for k in ("rate", "dist", "step")}}


def per_head(calibration: bytes) -> bool:
    """Whether calibration bytes have per-head bases (:func:`fit` with ``per_head=True``)."""
    return len(calibration) >= 48 and bool(struct.unpack_from("<I", calibration, 44)[0] & 4)


def _entropy_bits(symbols: np.ndarray) -> np.ndarray:
    """Empirical entropy (bits) of each column of small non-negative integers."""
    n, cols = symbols.shape
    counts = np.bincount((symbols + 255 * np.arange(cols)).ravel(), minlength=255 * cols).reshape(cols, 255)
    p = counts / n
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log2(p), 0).sum(1)


def _plane_curve(plane: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dynamic program over a plane's components: the least distortion at each total rate (UNITS
    per bit per token) and the choices that reach it. Returns (distortion[R], choice[c, R], rates)."""
    rates = np.rint(plane["rate"] * UNITS).astype(np.int64)
    dist = plane["dist"]
    components, options = rates.shape
    top = components * MAX_BITS * UNITS
    best = np.full(top + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((components, top + 1), np.int8)
    for c in range(components):
        new = np.full(top + 1, np.inf)
        arg = np.zeros(top + 1, np.int8)
        for o in range(options):
            r = rates[c, o]
            if r > top:
                continue
            cand = np.full(top + 1, np.inf)
            cand[r:] = best[: top + 1 - r] + dist[c, o]
            better = cand < new
            new[better], arg[better] = cand[better], o
        best, choice[c] = new, arg
    return best, choice, rates


def _allocate(planes: list[dict], curves: list, weights: list[float], budget_per_plane: float) -> list[np.ndarray]:
    """Steps per component of every plane for a total budget (rate units per token, on average per
    plane): on the planes' rate-distortion curves, a Lagrange multiplier that meets the budget."""
    budget = budget_per_plane * len(planes)

    def pick(nu):
        return [int(np.argmin(w * d + nu * np.arange(len(d)))) for (d, _, _), w in zip(curves, weights)]

    lo, hi = 1e-12, 1e6
    for _ in range(80):  # bisection on log(nu): more nu, fewer bits
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if sum(pick(mid)) <= budget else (mid, hi)
    out = []
    for (_, choice, rates), at, plane in zip(curves, pick(hi), planes):
        options = np.zeros(len(rates), np.int64)
        for c in range(len(rates) - 1, -1, -1):  # walk the program back from the chosen total rate
            options[c] = choice[c, at]
            at -= rates[c, options[c]]
        out.append(plane["step"][np.arange(len(rates)), options])
    return out


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, leave=False)


class _State:
    """The per-model state the ``kvtc`` codec codes with (:data:`kdn.codecs.ModelState`): a model's
    calibration, filed in the tiers at :func:`calibration_key`."""

    key = staticmethod(calibration_key)
    load = staticmethod(load)
    calibrate = staticmethod(calibrate)

    @staticmethod
    def needed(blob) -> bytes | None:
        return _core.kvtc_blob_calibration(blob)

    @staticmethod
    def loaded(state_id: bytes) -> bool:
        return _core.kvtc_loaded(state_id)

    @staticmethod
    def load_blob(blob, fingerprint: bytes, key: bytes) -> None:
        _core.kvtc_load_blob(blob, fingerprint, key)

    @staticmethod
    def pack(fingerprint: bytes, key: bytes, payload: bytes) -> bytes:
        return _core.kvtc_pack(fingerprint, key, payload)


STATE = _State()
