"""Offline verification of a store (``kdn verify``): rebuild stored prompts from their pointers,
recompute them with the model, and compare every stored chunk with the recomputation.

A store holds chunks under chained keys, which cannot be inverted; but every stored chunk has
pointers (written with ``probe_step > 0``, the default) that carry its tokens and position. The
chain is rebuilt from them: a chunk at position 0 has the root as parent, and a chunk at position
p is the child of the stored chunk at p - chunk_size whose key, chained with the chunk's tokens,
gives the chunk's key (recomputed, never trusted). A sample of the prompts so rebuilt is prefilled
by the model and each chunk compared plane by plane (:func:`kdn.engine.verify.plane_error`).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from kdn import _core
from kdn._core import BlobError
from kdn.engine.chunks import ChunkIO
from kdn.engine.session import ROOT, ModelSession
from kdn.engine.verify import EXACT_TOLERANCE, plane_error


@dataclasses.dataclass
class AuditReport:
    """What :func:`audit` found: ``prompts`` rebuilt (``checked`` of them recomputed), ``compared``
    chunks, ``mismatches`` (keys of chunks that differ from the recomputation), ``dropped`` (keys
    removed, with ``drop``), ``worst`` (the largest plane error of an honest chunk), ``unreached``
    (this model's chunks that no rebuilt prompt reaches: a chunk whose tokens leave an earlier stored
    chunk's only in its last ``probe_step`` tokens has no pointer of its own, and is not checked),
    ``invalid`` (rebuilt prompts holding token ids outside the model's vocabulary: no model wrote
    them, none is recomputed)."""

    entries: int = 0
    unreached: int = 0
    prompts: int = 0
    checked: int = 0
    compared: int = 0
    mismatches: list = dataclasses.field(default_factory=list)
    dropped: list = dataclasses.field(default_factory=list)
    worst: float = 0.0
    invalid: int = 0
    stored: list = dataclasses.field(default_factory=list)  # the rebuilt prompts' tokens (``kdn ls``)


def stored_prompts(io: ChunkIO, session: ModelSession, keys) -> tuple[list[np.ndarray], int, int]:
    """``(prompts, entries, unreached)``: the token sequences of the stored chains that end in a
    chunk no other stored chunk continues (from the pointers among ``keys``), how many keys were
    read, and how many of this model's chunks no rebuilt chain reaches."""
    chunks: dict[bytes, tuple[int, np.ndarray]] = {}  # chunk key -> (position, tokens), from its pointers
    kv_chunks: set[bytes] = set()
    entries = 0
    for key in keys:
        entries += 1
        blobs, _ = io.tiers.fetch([key], exact=True)
        if not blobs:
            continue
        try:
            header = _core.blob_parse(blobs[0])
            if header["kind"] == "kv" and header["fingerprint"] == session.fingerprint:
                kv_chunks.add(key)
            if header["kind"] != "pointer":
                continue
            target, position, tokens = _core.read_pointer(blobs[0], session.fingerprint, key)
        except BlobError:
            continue  # another model's, or damaged: not this audit's
        if target not in chunks or len(tokens) > len(chunks[target][1]):
            chunks[target] = (position, np.asarray(tokens, dtype=np.uint32))
    size = session.chunk_size
    by_position: dict[int, list] = {}
    for key, (position, tokens) in chunks.items():
        by_position.setdefault(position, []).append((key, tokens))
    prefix: dict[bytes, np.ndarray] = {ROOT: np.zeros(0, dtype=np.uint32)}  # chunk key -> its prompt's tokens
    parents: set[bytes] = set()
    for position in sorted(by_position):
        candidates = [ROOT] if position == 0 else [k for k, t in by_position.get(position - size, [])
                                                   if len(t) == size and k in prefix]
        for key, tokens in by_position[position]:
            parent = next((p for p in candidates if session.chunk_key(p, tokens) == key), None)
            if parent is not None:
                prefix[key] = np.concatenate([prefix[parent], tokens])
                parents.add(parent)
    leaves = [tokens for key, tokens in prefix.items() if key != ROOT and key not in parents]
    unreached = len(kv_chunks - set(prefix))
    return sorted(leaves, key=lambda t: (len(t), t.tobytes())), entries, unreached


def audit(io: ChunkIO, session: ModelSession, recompute, keys, sample: int | None = None, drop: bool = False,
          seed: int = 0, progress=None) -> AuditReport:
    """Recompute up to ``sample`` stored prompts (all with None; ``recompute(ids)``: the KV list of a
    full prefill of ``[1, n]`` ids, on the CPU; unused with ``sample=0``) and compare their
    chunks with the store; with ``drop``, chunks that differ are dropped from every tier (with
    their pointers; ``sample=0``: none, the prompts rebuilt only). ``progress(iterable)`` wraps the
    loop (a progress bar)."""
    prompts, entries, unreached = stored_prompts(io, session, keys)
    report = AuditReport(entries=entries, prompts=len(prompts), unreached=unreached, stored=prompts)
    chosen = prompts if sample is None or sample >= len(prompts) else random.Random(seed).sample(prompts, sample)
    tolerance = EXACT_TOLERANCE.get(session.layout.torch_dtype, 6e-2)
    size = session.chunk_size
    vocab = session.layout.vocab_size
    for tokens in (progress or iter)(chosen):
        if tokens.size and int(tokens.max()) >= vocab:
            report.invalid += 1
            continue
        stored, hit = io.read(session, tokens, len(tokens))
        if hit == 0:
            continue
        report.checked += 1
        found = io.find(session, tokens, hit)
        reference = recompute(torch.as_tensor(tokens[:hit].astype(np.int64))[None])
        differ = []
        for i in range(len(found.keys)):
            rows = slice(i * size, min((i + 1) * size, hit))
            error = plane_error([t[:, :, rows] for t in stored], [t[:, :, rows] for t in reference])
            report.compared += 1
            if error > tolerance:
                differ.append(i)
                report.mismatches.append(found.keys[i])
            else:
                report.worst = max(report.worst, error)
        if differ and drop:
            report.dropped += io.drop_chunks(session, tokens, found, differ)
    return report
