"""The one engine every face holds: sessions, the chunk reader/writer and the layer-wise deliverer of a config.

The HF facade (:class:`kdn.KDN`), the HF ``generate`` integration, blending, editing and both
halves of the vLLM connector drive kdn through an :class:`Engine` and nothing else: ``lookup``,
``load`` (whole or layer-wise, decided here once) and ``save`` (through the one rule of
:mod:`kdn.engine.served`: KV computed over lossy or edited KV, or over a load that failed, is never
stored under exact keys).

Example:
    >>> from kdn.engine import Engine, HFTarget
    >>> engine = Engine(kdn.KDNConfig(chunk_size=16))
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
from collections.abc import Callable

from kdn.delivery.stream import Deliverer, LayerStream
from kdn.engine.chunks import ChunkIO, Packed
from kdn.engine.served import Served
from kdn.engine.session import ModelSession, Sessions
from kdn.engine.targets import Target
from kdn.keys import tenant_fingerprint
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


class Engine:
    """kdn's engine for one :class:`kdn.KDNConfig`: its tiers (:class:`kdn.storage.TierManager`), the
    chunk reader/writer (:attr:`chunks`), the layer-wise deliverer (:attr:`delivery`) and the model
    sessions (:meth:`session` for a live model; faces that know a model by its checkpoint build a
    :class:`ModelSession` themselves)."""

    def __init__(self, config, tiers: TierManager | None = None):
        self.config = config
        self.chunks = ChunkIO(tiers if tiers is not None else TierManager(config))
        self.delivery = Deliverer(self.chunks, config)
        self.sessions = Sessions(config.chunk_size, min(config.probe_step, config.chunk_size),
                                 on_new=self.chunks.load_calibration, namespace=config.namespace,
                                 key=config.tenant_key())

    def session(self, model, namespace: str | None = None) -> ModelSession:
        """The engine's view of a live model: KV layout, fingerprint, prefix and segment keys, in the
        config's tenant (``namespace``, ``secret``) and, when given, the tenant ``namespace`` within it."""
        return self.sessions.of(model).within(namespace)

    def checkpoint_session(self, layout, fingerprint: bytes) -> ModelSession:
        """The session of a model known by its checkpoint's ``fingerprint``
        (:func:`kdn.keys.checkpoint_fingerprint`; a vLLM scheduler has no weights), in the config's tenant."""
        config = self.config
        return ModelSession(layout, tenant_fingerprint(fingerprint, config.namespace, config.tenant_key()),
                            config.chunk_size, min(config.probe_step, config.chunk_size))

    def lookup(self, session: ModelSession, tokens, limit: int) -> int:
        """Leading tokens of ``tokens`` (at most ``limit``) a load would serve; only pointers are read."""
        return self.chunks.available(session, tokens, limit)

    def load(self, session: ModelSession, tokens, limit: int, target: Target,
             layers: Callable[[int], Target] | None = None, started: float | None = None) -> Load:
        """The stored prefix of ``tokens`` (at most ``limit`` tokens) into ``target``; with ``layers``
        (a target for a hit of n tokens: ``layers(n)``) and ``config.delivery == "layerwise"``, as a
        layer-wise stream when the prefix can be streamed, else whole. A chunk that fails
        verification ends the hit before it (dropped, logged); a miss is ``Load()``."""
        if layers is not None and self.config.delivery == "layerwise":
            opened = self.delivery.open(session, tokens, limit, started, layers)
            if opened is not None:  # else not streamable (e.g. a keyed remote tier): read whole
                stream, hit = opened
                return Load(hit, stream=stream) if hit else Load()
        info: dict = {}
        result, hit = self.chunks.read(session, tokens, limit, target, info)
        return Load(hit, info.get("lossy", False), result=result) if hit else Load()

    # -- claims: engines sharing a remote store tell each other which chunk each is computing ----
    def computing_keys(self, session: ModelSession, tokens, hit: int) -> list[bytes]:
        """The keys of the full chunks a prefill of ``tokens`` computes after a hit of ``hit``
        tokens, in order (empty: no remote store to tell, or no full chunk left)."""
        if self.chunks.remote is None:
            return []
        return session.prefix_keys(session.tokens(tokens))[hit // session.chunk_size:]

    def claim(self, keys: list[bytes], owner: str, ttl: float) -> bool | None:
        """Tell the engines sharing the remote store that ``owner`` computes the chunks ``keys`` for
        a lease of ``ttl`` seconds (the first decides: True if ``owner`` holds it, False if another
        owner's claim on it is live, None when the store cannot tell: compute then, never wait;
        :meth:`kdn.storage.remote.RemoteTier.claim`)."""
        return self.chunks.remote.claim(keys[0], owner, ttl, also=keys[1:])

    def renew_claims(self, keys: list[bytes], owner: str, ttl: float) -> None:
        """Extend ``owner``'s leases on ``keys`` (claimed with :meth:`claim`) by ``ttl`` seconds."""
        if self.chunks.remote is not None:
            self.chunks.remote.renew(keys, owner, ttl)

    def pack(self, session: ModelSession, tokens, source) -> Packed:
        """The part of a save that reads the KV: the chunks of ``tokens`` no local tier holds, sealed
        from ``source`` (HF per-layer CPU tensors, or an engine's :class:`kdn.engine.targets.PagedBlocks`,
        gathered straight into the blobs), for :meth:`save` to file later (an engine packs before
        it reuses its blocks, and stores from another thread)."""
        return self.chunks.pack(session, tokens, source)

    def save(self, session: ModelSession, tokens, kv, served: Served | None = None) -> int:
        """Store the KV of ``tokens`` (HF per-layer CPU tensors, or what :meth:`pack` made of them)
        unless what ``served`` says forbids it (:mod:`kdn.engine.served`); the leading tokens a load
        can now serve (0 when refused)."""
        return self.chunks.save(session, tokens, kv, served if served is not None else Served())

    def flush(self) -> None:
        self.chunks.flush()

    def stats(self) -> dict:
        return {**self.chunks.stats(), "delivery": self.delivery.stats()}
