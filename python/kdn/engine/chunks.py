"""The chunk reader/writer: keys -> tiers -> verify -> decode -> a target layout, and back.

Every reader of stored KV goes through :class:`ChunkIO`, so a corrupt, foreign or undecodable
chunk is handled in one place: it ends the hit before it, is dropped from the tiers, and is
logged once; it is never served.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kdn import _core
from kdn._core import BlobError
from kdn.engine.calibrations import Calibrations
from kdn.engine.served import Served
from kdn.engine.session import ROOT, ModelSession
from kdn.engine.targets import HFTarget
from kdn.engine.verify import Verifier
from kdn.storage import TierManager

log = logging.getLogger("kdn")


@dataclasses.dataclass
class Prefix:
    """Where the stored KV of a prompt's prefix lives: ``keys`` of the chunks that hold it, in order
    (the last reached through a pointer when ``last_tokens`` is not 0: a chunk of that many tokens
    that the prompt shares only partly) and the ``tokens`` of the prompt they cover; ``holders``,
    when asked (:meth:`kdn.storage.TierManager.holders`): the fastest local tier holding each."""

    keys: list
    tokens: int
    last_tokens: int = 0
    holders: tuple = ()

    def clip(self, limit: int, chunk: int) -> Prefix:
        """The part of this prefix that serves at most ``limit`` tokens (chunks of ``chunk`` tokens)."""
        if limit >= self.tokens:
            return self
        n = -(-max(0, limit) // chunk)
        return Prefix(self.keys[:n], max(0, limit), self.last_tokens if n == len(self.keys) else 0, self.holders[:n])


@dataclasses.dataclass
class Packed:
    """A store's chunks, sealed (:meth:`ChunkIO.pack`): ``keys`` of every chunk it files, in order, and
    ``blobs[i]`` for chunk i when no local tier held it at packing time."""

    keys: list
    blobs: dict


class ChunkIO:
    """Reads and writes a model's chunks through a :class:`~kdn.storage.TierManager`.

    Hits are token-granular: a stored prompt is a chain of full chunks and, where it ends inside a
    chunk, a partial one; beside each chunk sit pointers filed under probes of its leading tokens
    (``probe_step``, 2 ``probe_step``, ...; :meth:`ModelSession.probe_keys`). A reader follows the
    chain as far as its own chunk keys go, then probes with its own next tokens: the longest probe
    held names a stored chunk that shares that many tokens or more, and the KV of the tokens it
    shares (exactly: the pointer carries the chunk's tokens) is valid for the reader whatever
    follows, attention being causal. Pointers are blobs like chunks (checksummed, bounded, evicted,
    in every tier), so this works across processes (disk) and machines (remote); a pointer is
    trusted for nothing: the chunk's key is recomputed from its parent and the pointer's tokens.

    Thread-safe as the tiers are. Never raises for storage faults: what cannot be read is a miss,
    what cannot be written is reported (and the count of retrievable tokens says so).

    Example:
        >>> from kdn.layout import cache_to_kv_list
        >>> config = kdn.KDNConfig(chunk_size=16)
        >>> session = kdn.KDN(config).session(model)
        >>> io = ChunkIO(TierManager(config))
        >>> tokens = session.tokens(ids)
        >>> kv = cache_to_kv_list(model(ids, use_cache=True).past_key_values)   # 2 * layers [1, heads, n, dim]
        >>> io.write(session, tokens, kv)          # tokens now retrievable: the full chunks
        48
        >>> served, hit = io.read(session, tokens, limit=len(tokens) - 1)
        >>> hit, all(torch.equal(s, t[:, :, :hit]) for s, t in zip(served, kv))
        (48, True)
    """

    def __init__(self, tiers: TierManager):
        self.tiers = tiers
        self.verifier = Verifier(tiers.config.verify_fraction)
        self.calibrations = Calibrations(tiers)
        self.refused_stores = 0  # saves refused by the fidelity rule (kdn.engine.served)

    # -- prefix chunks --------------------------------------------------------------------------
    def available(self, session: ModelSession, tokens: np.ndarray, limit: int | None = None) -> int:
        """Leading tokens of ``tokens`` (at most ``limit``) whose KV some tier holds (only pointers
        are read, no KV)."""
        return self.find(session, tokens, len(tokens) if limit is None else limit).tokens

    def find(self, session: ModelSession, tokens: np.ndarray, limit: int) -> Prefix:
        """The stored chunks that serve the longest prefix of ``tokens``, at most ``limit`` tokens."""
        chunk = session.chunk_size
        limit = max(0, min(limit, len(tokens)))
        keys = session.prefix_keys(tokens)[: -(-limit // chunk)]
        n = self.tiers.count_prefix(keys)
        full = Prefix(keys[:n], min(n * chunk, limit))
        start = n * chunk
        if start >= limit:
            return full
        rest = tokens[start:min(start + chunk, limit)]
        if len(rest) < max(session.probe_step, 1):
            return full
        parent = keys[n - 1] if n else ROOT
        probes = session.probe_keys(parent, rest)
        held = [i for i, flag in enumerate(self.tiers.held(probes)) if flag]
        if not held:
            return full
        probe = probes[held[-1]]
        blobs, _ = self.tiers.fetch([probe], exact=True)
        try:
            if not blobs:
                raise BlobError("evicted since it was found")
            target, position, chunk_tokens = _core.read_pointer(blobs[0], session.fingerprint, probe)
            if position != start or session.chunk_key(parent, chunk_tokens) != target:
                raise BlobError("it does not name a chunk of its tokens at its position")
            if self.tiers.count_prefix([target]) != 1:  # its write dropped (a full queue), the pointer's not
                raise BlobError("the chunk it names is not stored")
        except BlobError as e:
            log.warning("kdn: dropping an unusable stored pointer (a shorter hit): %s", e)
            self.tiers.drop(probe)
            return full
        differ = np.flatnonzero(chunk_tokens[: len(rest)] != rest[: len(chunk_tokens)])
        shared = int(differ[0]) if differ.size else min(len(rest), len(chunk_tokens))
        if shared == 0:
            return full
        return Prefix(full.keys + [target], start + shared, len(chunk_tokens))

    def read(self, session: ModelSession, tokens: np.ndarray, limit: int, target: HFTarget | None = None,
             info: dict | None = None, found: Prefix | None = None):
        """``(kv, hit)``: the KV of the longest stored prefix of ``tokens``, at most ``limit`` tokens,
        as ``target.receive`` lays it out (default :class:`HFTarget`: HF per-layer tensors on the CPU;
        vLLM's connector passes its paged blocks); ``(None, 0)`` on a miss. ``info["lossy"]`` says
        whether a lossy coding was served (KV computed on top of it must not be stored as exact).
        ``found``: what a lookup of these tokens found (:meth:`find`), read without looking again."""
        chunk = session.chunk_size
        found = self.find(session, tokens, limit) if found is None else found.clip(limit, chunk)
        skip = self.unread(target, found, chunk)
        blobs, addresses, n_ok = self.fetch_verified(session, found, skip=skip,
                                                     sections=self.sections(target, found, chunk, skip))
        hit = found.tokens if n_ok == len(found.keys) else min(n_ok * chunk, found.tokens)
        if info is not None:
            info["lossy"] = any(a != k for a, k in zip(addresses, found.keys[skip:]))
        if n_ok <= skip:  # a miss, or none of what the target lays
            return None, 0
        used = -(-hit // chunk) - skip
        try:
            return (target or HFTarget()).receive(session, blobs[:used], hit), hit
        except BlobError as e:  # a coded payload that its checksum did not catch: a miss, never wrong KV
            log.warning("kdn: dropping undecodable stored chunks (treated as a miss): %s", e)
            self.drop(addresses[:used])
            return None, 0

    @staticmethod
    def unread(target, found: Prefix, chunk: int) -> int:
        """How many leading chunks of ``found`` a load into ``target`` need not read: those it lays
        nothing from (its ``unread_chunks``: a prefix the engine holds, a sliding window's start);
        the last chunk is always read."""
        unread = getattr(target, "unread_chunks", None)
        return min(unread(chunk), len(found.keys) - 1) if unread is not None and found.keys else 0

    @staticmethod
    def sections(target, found: Prefix, chunk: int, skip: int) -> list | None:
        """Per chunk of ``found`` from chunk ``skip`` on, the blob sections a load into ``target`` lays
        (its ``chunk_layers``: a sliding layer takes nothing before its window), None for a chunk whose
        every layer it lays; None for a target that lays every layer of every chunk."""
        layers_of = getattr(target, "chunk_layers", None)
        if layers_of is None:
            return None
        spans = []
        for i in range(skip, len(found.keys)):
            layers = layers_of(i * chunk, min((i + 1) * chunk, found.tokens))
            # a chunk nothing is laid from (read to keep the hit's chunks whole blocks): its first plane
            spans.append(None if layers is None else [(1 + 2 * lo, 2 * hi) for lo, hi in layers] or [(1, 1)])
        return spans if any(s is not None for s in spans) else None

    def fetch_verified(self, session: ModelSession, found: Prefix, local: bool = False,
                       skip: int = 0, sections: list | None = None) -> tuple[list, list, int]:
        """``(blobs, addresses, n)``: the chunks of ``found`` from chunk ``skip`` on that some tier (a
        local one, with ``local``) holds and that pass verification (checksum, model, key, position,
        tokens), up to the first that does not, and ``n``: the prefix's chunks they reach (``skip +
        len(blobs)``); the first one that fails is dropped from the tiers and logged. ``sections``
        (:meth:`sections`): what to read of each, where a tier can read part of a blob."""
        blobs, addresses = self.tiers.fetch(found.keys[skip:], local=local, sections=sections)
        calibrated = self.calibrations.decodable(session, blobs)
        if calibrated < len(blobs):  # coded under a calibration not at hand: a miss, the chunk stays stored
            blobs, addresses = blobs[:calibrated], addresses[:calibrated]
        layout = session.layout
        last_tokens = found.last_tokens if skip + len(blobs) == len(found.keys) else 0
        n_ok, error = _core.verify_chunks(blobs, addresses, session.fingerprint, layout.dtype, layout.layers,
                                          layout.kv_heads, layout.head_dim, session.chunk_size, last_tokens,
                                          first_chunk=skip)
        if error:
            log.warning("kdn: dropping an unusable stored chunk (treated as a miss): %s", error)
            self.tiers.drop(addresses[n_ok])
        return blobs[:n_ok], addresses[:n_ok], skip + n_ok

    def save(self, session: ModelSession, tokens: np.ndarray, kv, served: Served) -> int:
        """Store the KV a model computed for ``tokens`` (per-layer CPU tensors, or what :meth:`pack`
        made of it) in a request that kdn served ``served``: the one place the fidelity rule is
        applied (:mod:`kdn.engine.served`). KV computed over lossy, suspect or never-loaded KV is
        refused (returns 0, logged at debug level); otherwise as :meth:`write`."""
        why = served.unstorable()
        if why is not None:
            self.refused_stores += 1
            log.debug("kdn: not storing a prompt of %d tokens: %s", len(tokens), why)
            return 0
        return self.write(session, tokens, kv)

    def unheld(self, session: ModelSession, tokens: np.ndarray) -> tuple[list, list]:
        """``(keys, todo)``: the keys of the chunks a store of ``tokens`` files (its full chunks and a
        trailing partial chunk of at least ``probe_step`` tokens), and ``(start, count, key)`` of
        those no local tier holds."""
        chunk = session.chunk_size
        keys = session.prefix_keys(tokens, include_partial=session.probe_step > 0)
        if len(tokens) % chunk and len(tokens) % chunk < session.probe_step:
            keys = keys[:-1]  # too short a tail for a probe to find
        todo = [(i * chunk, min(chunk, len(tokens) - i * chunk), key) for i, key in enumerate(keys)
                if not self.tiers.contains_local(key)]
        return keys, todo

    def pack(self, session: ModelSession, tokens: np.ndarray, source, unheld: tuple | None = None) -> Packed:
        """The chunks a store of ``tokens`` files, sealed from ``source`` (per-layer CPU tensors
        holding at least ``len(tokens)`` tokens, or a source with ``pack(chunks, fingerprint)`` such
        as an engine's paged blocks, :class:`kdn.engine.targets.PagedBlocks`) except those a local
        tier holds already (``unheld``: :meth:`unheld`'s answer, asked now by default): the part of
        a store that reads the KV (an engine packs before its blocks are reused)."""
        chunk = session.chunk_size
        keys, todo = unheld if unheld is not None else self.unheld(session, tokens)
        if isinstance(source, (list, tuple)):
            blobs = _core.pack_chunks(source, todo, session.fingerprint)
        else:
            blobs = source.pack(todo, session.fingerprint)
        return Packed(keys, {start // chunk: blob for (start, _, _), blob in zip(todo, blobs)})

    def write(self, session: ModelSession, tokens: np.ndarray, kv) -> int:
        """Store the KV of ``tokens`` from ``kv`` (per-layer CPU tensors holding at least
        ``len(tokens)`` tokens, or what :meth:`pack` made of them): its chunks and their pointers;
        chunks already held are skipped. Returns the leading tokens a :meth:`read` can now serve,
        with one warning when that is fewer than given."""
        packed = kv if isinstance(kv, Packed) else self.pack(session, tokens, kv)
        chunk, keys = session.chunk_size, packed.keys
        written, pointers = 0, []
        for i, key in enumerate(keys):
            start = i * chunk
            count = min(chunk, len(tokens) - start)
            blob = packed.blobs.get(i)
            if blob is not None:
                if not self.tiers.put(key, blob):
                    log.warning("kdn: chunk of %d bytes fits no tier (pinned entries hold the space?); not stored",
                                len(blob))
                    break
                pointers.append((keys[i - 1] if i else ROOT, key, tokens[start:start + count], start))
            written += count
        self._point_to(session, pointers)
        stored = -(-written // chunk)
        held = self.tiers.count_prefix(keys[:stored])
        retrievable = written if held == stored else held * chunk
        if retrievable < written:  # the prompt's tail evicted its own head
            log.warning("kdn: stored %d tokens but only the first %d can be retrieved: the prompt's KV is larger "
                        "than the tiers hold (memory_bytes=%d; add a disk tier or raise memory_bytes)",
                        written, retrievable, self.tiers.config.memory_bytes)
        return retrievable

    def _point_to(self, session: ModelSession, chunks: list) -> None:
        """File pointers to each new chunk ``(parent, key, tokens, position)`` under the probes of its
        tokens (not the probe of a whole chunk: its own key answers that), with one existence check
        for all of them; a probe already filed keeps its first chunk."""
        filed = [(probe, chunk) for chunk in chunks
                 for probe in session.probe_keys(chunk[0], chunk[2][: session.chunk_size - 1])]
        for (probe, (_, key, tokens, position)), held in zip(filed, self.tiers.held([p for p, _ in filed])):
            if not held:
                self.tiers.put(probe, _core.pack_pointer(session.fingerprint, probe, key, position, tokens))

    @property
    def remote(self):
        """The remote tier (:class:`kdn.storage.remote.RemoteTier`), or None: what delivery streams from."""
        return self.tiers.remote

    def drop(self, addresses: list[bytes]) -> None:
        """Drop what is filed under each of ``addresses`` from every tier (an unusable chunk)."""
        for address in addresses:
            self.tiers.drop(address)

    def keep(self, address: bytes, blob, lossy: bool) -> None:
        """Keep a chunk the remote tier served whole (verified) in the local tiers, as a read would."""
        self.tiers.promote(address, blob, "remote", lossy)

    def flush(self) -> None:
        """Wait until queued disk writes are on disk and queued remote stores are sent."""
        self.tiers.flush()

    def stats(self) -> dict:
        """Per-tier counters (see :meth:`kdn.KDN.stats`) and ``"integrity"``: verification counters
        (:class:`~kdn.engine.verify.Verifier`) and saves refused by the fidelity rule."""
        return {**self.tiers.stats(), "integrity": {**self.verifier.stats(), "refused_stores": self.refused_stores}}

    def drop_chunks(self, session: ModelSession, tokens: np.ndarray, found: Prefix, indices: list[int]) -> list:
        """Drop the chunks ``indices`` of ``found`` (the stored prefix of ``tokens``) from every tier, at
        every fidelity (exact and each lossy address), with the pointers filed under the probes of
        their tokens (so no lookup finds them again): chunks that failed verification. Returns their keys."""
        chunk = session.chunk_size
        for i in indices:
            for address in self.tiers.addresses(found.keys[i]):
                self.tiers.drop(address)
            parent = found.keys[i - 1] if i else ROOT
            for probe in session.probe_keys(parent, tokens[i * chunk:(i + 1) * chunk]):
                self.tiers.drop(probe)
        return [found.keys[i] for i in indices]

    def clear(self) -> None:
        """Drop every stored chunk and pointer from every tier."""
        self.tiers.clear()

    def remove(self, session: ModelSession, tokens: np.ndarray, first: int = 0) -> int:
        """Drop the chunks of ``tokens`` from chunk ``first`` on (and their pointers) from every tier;
        returns how many chunks were held."""
        chunk = session.chunk_size
        keys = session.prefix_keys(tokens, include_partial=True)
        held = 0
        for i, key in enumerate(keys):
            if i < first:
                continue
            held += self.tiers.remove(key)
            for probe in session.probe_keys(keys[i - 1] if i else ROOT, tokens[i * chunk:(i + 1) * chunk]):
                self.tiers.drop(probe)
        return held

    def stored_bytes(self, key: bytes) -> int:
        """Size of the blob filed under ``key`` (in any coding) as the first tier holding it stores it, or 0."""
        blobs, _ = self.tiers.fetch([key])
        return len(blobs[0]) if blobs else 0

    def holds(self, key: bytes) -> bool:
        """Whether some tier holds the blob filed under ``key`` (in any coding it may be read in);
        reads no KV."""
        return self.tiers.count_prefix([key]) == 1

