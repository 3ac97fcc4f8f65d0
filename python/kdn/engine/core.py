"""The one engine every face holds: sessions, the chunk reader/writer and the layer-wise deliverer of a config.

The HF facade (:class:`kdn.KDN`), the HF ``generate`` integration, blending, editing and both
halves of the vLLM connector drive kdn through an :class:`Engine` and nothing else: ``lookup``,
``load`` (whole or layer-wise, decided here once) and ``save`` (through the one rule of
:mod:`kdn.engine.served`: KV computed over lossy or edited KV, or over a load that failed, is never
stored under exact keys).

Example:
    >>> from kdn.engine import Engine, HFTarget
    >>> engine = Engine(kdn.KDNConfig(chunk_size=16), layout_of=kdn.layout.layout_of)  # live HF models
    >>> session = engine.session(model)
    >>> tokens = session.tokens(ids)
    >>> kv = [t.detach() for t in kdn.layout.cache_to_kv_list(model(ids, use_cache=True).past_key_values)]
    >>> engine.save(session, tokens, kv)     # an unserved prefill: 3 chunks of 16 (a short tail is not kept)
    48
    >>> load = engine.load(session, tokens, len(tokens) - 1, HFTarget("cpu"))
    >>> load.hit, load.lossy, tuple(load.result[0].shape)
    (48, False, (1, 4, 48, 8))
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from kdn._core import InvalidInputError
from kdn.config_sources import apply_process_env
from kdn.engine.audit import AuditReport
from kdn.engine.audit import audit as audit_stored
from kdn.engine.chunks import ChunkIO, Packed, Prefix
from kdn.engine.host_pool import prepare_for
from kdn.engine.keeping import Keeping
from kdn.engine.pages import Pages
from kdn.engine.parts import Segments, Sidecars
from kdn.engine.served import Served
from kdn.engine.session import ModelSession, Sessions
from kdn.engine.stream import Deliverer, DeliveryError, LayerStream
from kdn.engine.targets import HFTarget, Target
from kdn.engine.verify import plane_error
from kdn.keys import shard_fingerprint, tenant_fingerprint
from kdn.storage import TierManager


@dataclasses.dataclass
class Load:
    """What a load served: ``hit`` tokens; ``lossy`` (a codec level or an edit: KV computed over it is
    never stored as exact; a stream's is known once it ends, in ``stream.stats``); ``stream``, the
    :class:`kdn.delivery.LayerStream` of a layer-wise load (its layers arrive in the background);
    ``result``, what the target returned for a whole load; ``edit``, the edit served, if any;
    ``bias``, per-layer attention biases the reader runs the model under (:func:`kdn.edits.steer.applied`):
    a ``steer`` edit's emphasis, or the mask over a pruned cache's padding rows."""

    hit: int = 0
    lossy: bool = False
    stream: LayerStream | None = None
    result: object = None
    edit: str | None = None
    bias: dict | None = None
    _deliverer: Deliverer | None = dataclasses.field(default=None, repr=False)

    def finish(self) -> Served:
        """What this load served, once it has ended: a layer-wise stream is waited for (its final
        ``lossy`` flag is known then; ``failed`` when it ended before delivering every layer, so the
        KV computed over it is not the prompt's and is never stored)."""
        lossy, failed = self.lossy, False
        if self.stream is not None:
            try:
                self.stream.wait_all()
            except DeliveryError:
                failed = not self.stream.delivered_all()
                if self._deliverer is not None:
                    self._deliverer.failed()
            lossy = lossy or self.stream.stats.get("lossy", False)
        return Served(tokens=self.hit, lossy=lossy, failed=failed)


class Engine(Keeping):
    """kdn's engine for one :class:`kdn.KDNConfig`: its tiers (:attr:`tiers`, a
    :class:`kdn.storage.TierManager`), the model sessions (:meth:`session` for a live model, whose
    layout ``layout_of(model)`` reads: :func:`kdn.layout.layout_of` for transformers,
    :meth:`checkpoint_session` / :meth:`for_checkpoint` for a model known by its checkpoint), and
    what faces file beside prefixes: :attr:`segments`, :attr:`sidecars`, :attr:`calibrations`
    (:mod:`kdn.engine.parts`). Its chunk reader/writer and deliverer are its own (``engine/`` only)."""

    _registry: list = []  # (config, (folder, dtype, heads), engine, session): one per checkpoint per process
    _registry_lock = threading.Lock()

    def __init__(self, config, tiers: TierManager | None = None, layout_of=None):
        apply_process_env()  # KDN_BUFFER_POOL_*: checked (a bad value is one typed error) and applied
        self.config = config
        self.chunks = ChunkIO(tiers if tiers is not None else TierManager(config))
        self.delivery = Deliverer(self.chunks, config)
        self.sessions = Sessions(config.chunk_size, min(config.probe_step, config.chunk_size),
                                 on_new=self._on_new_session, namespace=config.namespace,
                                 key=config.tenant_key(), layout_of=layout_of)
        self.segments, self.sidecars = Segments(self.chunks.tiers), Sidecars(self.chunks.tiers)
        self.calibrations = self.chunks.calibrations

    def _on_new_session(self, session: ModelSession) -> None:
        """A model's first session here: its codec calibration loaded, its tenants' quotas set."""
        self.calibrations.load(session)
        self._set_quotas(session)

    def _set_quotas(self, session: ModelSession) -> None:
        for namespace, quota in self.config.quotas:  # each tenant's blobs carry its scoped fingerprint
            self.chunks.tiers.set_quota(session.within(namespace).fingerprint, quota)

    @classmethod
    def for_checkpoint(cls, config, folder, dtype, describe, heads=None) -> tuple[Engine, ModelSession]:
        """This process' engine and session for the checkpoint in ``folder`` run in ``dtype`` under
        ``config`` (one per equal config, the ``secret`` included: a process' faces share its tiers),
        for a serving engine without the model's weights. ``describe()``: the checkpoint's
        ``(ModelLayout, fingerprint)``, asked on first use only (:func:`kdn.layout.describe_checkpoint`
        for a transformers checkpoint); ``heads``: ``(first, count)`` of the KV heads this process
        holds (a tensor-parallel rank's, keyed apart: :func:`kdn.keys.shard_fingerprint`), None: all."""
        with cls._registry_lock:
            for known, place, engine, session in cls._registry:
                if place == (str(folder), str(dtype), heads) and known == config:
                    return engine, session
            layout, fingerprint = describe()
            if layout.recurrent:  # a serving engine's recurrent state is not stored yet (docs/models.md)
                raise InvalidInputError("kdn serves a hybrid model in its HF face only, not in a serving engine")
            if heads is not None:
                fingerprint = shard_fingerprint(fingerprint, *heads, layout.kv_heads)
                layout = dataclasses.replace(layout, kv_heads=heads[1])
            engine = cls(config)
            session = engine.checkpoint_session(layout, fingerprint)
            cls._registry.append((config, (str(folder), str(dtype), heads), engine, session))
            return engine, session

    @classmethod
    def checkpoint_engines(cls) -> list[Engine]:
        """The engines :meth:`for_checkpoint` made in this process."""
        with cls._registry_lock:
            return [entry[2] for entry in cls._registry]

    def pages(self, fingerprint: bytes) -> Pages:
        """Pages a serving engine addresses by its own keys (SGLang HiCache's page hashes), for the model
        (and shard) of identity ``fingerprint`` (16 bytes) in the config's tenant (:class:`kdn.engine.pages.Pages`)."""
        return Pages(self.tiers, tenant_fingerprint(fingerprint, self.config.namespace, self.config.tenant_key()))

    def tier(self, name: str):
        """The engine's ``"memory"``, ``"node"``, ``"disk"`` or ``"remote"`` tier (but memory: None
        when the config has none), for a face that shows its counters or clears it."""
        if name not in ("memory", "node", "disk", "remote"):
            raise InvalidInputError(f"tier: 'memory', 'node', 'disk' or 'remote', got {name!r}")
        return self.chunks.tiers.tier(name)

    @property
    def tiers(self) -> TierManager:
        """The tiers (memory, disk, remote) the engine reads and writes."""
        return self.chunks.tiers

    @property
    def estimates(self):
        """What layer-wise delivery knows of the link and the model's prefill speed (the prefills faces time)."""
        return self.delivery.estimates

    @estimates.setter
    def estimates(self, value) -> None:
        self.delivery.estimates = value

    def session(self, model, namespace: str | None = None) -> ModelSession:
        """The engine's view of a live model: KV layout, fingerprint, prefix and segment keys, in the
        config's tenant (``namespace``, ``secret``) and, when given, the tenant ``namespace`` within it."""
        return self.sessions.of(model).within(namespace)

    def serving_on(self, device, hit_bytes: int = 0) -> None:
        """A model this engine serves computes on ``device`` (a ``torch.device``), its longest hit
        ``hit_bytes`` of KV: on a CUDA device (with ``config.pin_host_memory``) kdn's pooled host buffers
        are page-locked from now on, and kept for one such hit (:func:`kdn.engine.host_pool.prepare_for`)."""
        prepare_for(device, self.config.pin_host_memory, hit_bytes)

    def checkpoint_session(self, layout, fingerprint: bytes) -> ModelSession:
        """The session, in the config's tenant, of a model known by its checkpoint's ``fingerprint``
        (:func:`kdn.keys.checkpoint_fingerprint`, or a shard's: :meth:`for_checkpoint`)."""
        config = self.config
        session = ModelSession(layout, tenant_fingerprint(fingerprint, config.namespace, config.tenant_key()),
                               config.chunk_size, min(config.probe_step, config.chunk_size))
        self._set_quotas(session)
        return session

    def lookup(self, session: ModelSession, tokens, limit: int) -> int:
        """Leading tokens of ``tokens`` (at most ``limit``) a load would serve; only pointers are read."""
        return self.chunks.available(session, tokens, limit)

    def load(self, session: ModelSession, tokens, limit: int, target: Target,
             layers: Callable[[int], Target] | None = None, started: float | None = None,
             found: Prefix | None = None) -> Load:
        """The stored prefix of ``tokens`` (at most ``limit`` tokens) into ``target``; with ``layers``
        (a target for a hit of n tokens: ``layers(n)``) and ``config.delivery == "layerwise"``, as a
        layer-wise stream when the prefix can be streamed, else whole. A chunk that fails
        verification ends the hit before it (dropped, logged); a miss is ``Load()``. ``found``: what
        :meth:`find` answered for these tokens (a scheduler's lookup): loaded without looking again."""
        if layers is not None and self.config.delivery == "layerwise":
            opened = self.delivery.open(session, tokens, limit, started, layers, found, whole=target)
            if opened is not None:  # else not streamable (e.g. a keyed remote tier): read whole
                stream, hit = opened
                return Load(hit, stream=stream, _deliverer=self.delivery) if hit else Load()
        info: dict = {}
        result, hit = self.chunks.read(session, tokens, limit, target, info, found)
        return Load(hit, info.get("lossy", False), result=result) if hit else Load()

    def find(self, session: ModelSession, tokens, limit: int, holders: bool = False) -> Prefix:
        """The stored chunks that serve the longest prefix of ``tokens`` (at most ``limit``): their
        keys, in order, and the tokens they cover (only pointers are read); with ``holders``, the
        fastest local tier holding each (a hit's ``CacheHitSource``; no data is read)."""
        found = self.chunks.find(session, tokens, limit)
        if holders:
            found = dataclasses.replace(found, holders=tuple(self.chunks.tiers.holders(found.keys)))
        return found

    # -- verification: a sampled hit's last tokens recomputed and compared (kdn.engine.verify) ----
    def sample_check(self, hit: int, lossy: bool = False) -> int:
        """How many of a hit's last tokens to recompute and compare with what was served (0: this
        hit is not checked: not sampled, or lossy, which one tolerance cannot judge yet)."""
        span = self.chunks.verifier.sample(hit)
        if span and lossy:
            self.chunks.verifier.tolerance(None, True)  # counted (skipped_lossy), logged once
            return 0
        return span

    def verify(self, session: ModelSession, tokens, check: tuple[int, int], computed: list, lossy: bool = False,
               served: list | None = None, reference: Callable[[], list] | None = None) -> bool | None:
        """Judge a sampled hit: the rows ``check = (start, end)`` a model computed over the served
        prefix (``computed``: per-layer tensors of those rows) against what kdn served (``served``:
        per-layer tensors from token 0; None: read from the tiers now). On a mismatch the chunks of
        the hit that differ from ``reference()`` (a full recompute's per-layer KV of ``[0, end)``) are
        dropped from every tier with their pointers, or every chunk of the hit without one. True when
        it passed, False when it failed, None when it could not be judged (evicted since, or lossy)."""
        start, end = check
        verifier = self.chunks.verifier
        if served is None:
            load = self.load(session, tokens[:end], end, HFTarget())
            if load.hit < end:
                return None
            served, lossy = load.result, lossy or load.lossy
        tolerance = verifier.tolerance(session.layout.torch_dtype, lossy)
        if tolerance is None:
            return None
        error = plane_error([t[:, :, start:end] for t in served], computed)
        if verifier.judge(error, tolerance):
            return True
        found = self.chunks.find(session, tokens, end)
        if reference is None:
            differ = list(range(len(found.keys)))
            why = f"the KV of tokens [{start}, {end}) differs from kdn's by {error:.3g} (tolerance {tolerance:.3g})"
        else:  # the first chunk that differs is wrong; later ones may be right yet computed over it
            full, size = reference(), session.chunk_size
            rows = [(i * size, min((i + 1) * size, end)) for i in range(len(found.keys))]
            differ = [i for i, (a, b) in enumerate(rows) if plane_error([t[:, :, a:b] for t in served],
                                                                          [t[:, :, a:b] for t in full]) > tolerance]
            why = f"{len(differ)} of {len(found.keys)} chunks of a {end}-token hit differ from a full recompute"
        verifier.dropped(self.chunks.drop_chunks(session, tokens, found, differ), why)
        return False

    def audit(self, session: ModelSession, recompute, keys, sample: int | None = None, drop: bool = False,
              seed: int = 0, progress=None) -> AuditReport:
        """Recompute stored prompts among ``keys`` (``recompute(ids)``: a full prefill's KV list of
        ``[1, n]`` ids, :func:`kdn.layout.full_kv` for a transformers model) and compare their chunks
        with the store (:func:`kdn.engine.audit.audit`)."""
        return audit_stored(self.chunks, session, recompute, keys, sample, drop, seed, progress)

    def pack(self, session: ModelSession, tokens, source, unheld: tuple | None = None) -> Packed:
        """The part of a save that reads the KV: the chunks of ``tokens`` no local tier holds, sealed
        from ``source`` (HF per-layer CPU tensors, or an engine's :class:`kdn.engine.targets.PagedBlocks`,
        gathered straight into the blobs), for :meth:`save` to file later (an engine packs before
        it reuses its blocks, and stores from another thread). ``unheld``: what :meth:`unheld` said
        when ``source`` was copied out (default: asked now)."""
        return self.chunks.pack(session, tokens, source, unheld)

    def unheld(self, session: ModelSession, tokens) -> tuple[list, list]:
        """``(keys, todo)``: the keys of the chunks a save of ``tokens`` files, and ``(start, count,
        key)`` of those no local tier holds (what :meth:`pack` seals)."""
        return self.chunks.unheld(session, tokens)

    def save(self, session: ModelSession, tokens, kv, served: Served | None = None) -> int:
        """Store the KV of ``tokens`` (HF per-layer CPU tensors, or what :meth:`pack` made of them)
        unless what ``served`` says forbids it (:mod:`kdn.engine.served`); the leading tokens a load
        can now serve (0 when refused)."""
        return self.chunks.save(session, tokens, kv, served if served is not None else Served())

    def flush(self) -> None:
        """Wait until queued disk writes are on disk and queued remote stores are sent."""
        self.chunks.flush()

    def close(self) -> None:
        """Flush, then release the remote store's connection (an engine's last call)."""
        self.chunks.flush()
        self.tiers.close()

    def stats(self) -> dict:
        """Per-tier counters, ``"integrity"`` (verification, refused stores) and ``"delivery"``."""
        return {**self.chunks.stats(), "delivery": self.delivery.stats()}
