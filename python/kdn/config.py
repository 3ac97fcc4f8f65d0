"""KDNConfig: the settings of a KDN object, from code, a YAML file or KDN_* variables, validated."""

from __future__ import annotations

import dataclasses
import functools
import os

from kdn import config_sources as sources
from kdn._core import InvalidInputError
from kdn.config_checks import check, default_cache_dir, default_node_dir  # noqa: F401 - imported from here
from kdn.config_sources import (  # noqa: F401 - the names users import from kdn.config
    INT_FIELDS,
    OPTIONAL_SECONDS,
    SECONDS_FIELDS,
    SIZE_FIELDS,
    GiB,
    KiB,
    MiB,
    TiB,
    check_namespace,
    parse_bytes,
)
from kdn.urls import redact


@dataclasses.dataclass(frozen=True)
class KDNConfig:
    """Settings of a :class:`kdn.KDN`.

    Attributes:
        chunk_size: tokens per stored chunk (default 256): the unit of storage and of lookup.
        probe_step: hits are token-granular: a prompt that leaves the stored chunks inside a
            chunk is served the tokens it shares with a stored chunk, found through small pointer
            blobs filed under probes of every ``probe_step`` leading tokens of each stored chunk
            (default 16: a shared run of at least 16 tokens is found, then served to the token;
            a value above ``chunk_size`` is used as ``chunk_size``; at most 1048576, larger values are
            refused as typos). 0: whole chunks only (no pointers are written or read).
        memory_bytes: capacity of the host-memory tier (default 4 GiB). Sizes accept ints or
            strings such as ``"512MiB"``.
        memory_policy: eviction order of the memory tier, ``"lru"`` (default) or ``"s3fifo"``
            (scan-resistant: one pass over many new documents does not flush the hot ones).
        node_dir: directory of the node tier: host memory shared by every kdn process on this
            machine (a folder on a tmpfs such as ``/dev/shm/kdn``; ``"auto"``: ``/dev/shm/kdn-<uid>``),
            between the memory tier and the disk. Engines and data-parallel ranks of one node see
            each other's chunks there without the disk, and what one wrote survives its crash.
            ``None`` (default): no node tier. Files, trust and sharing as the disk tier's, without
            fsync.
        node_bytes: capacity of the node tier (default 8 GiB).
        disk_dir: directory of the local-disk tier; ``None`` (default) turns the tier off,
            ``"auto"`` uses :func:`default_cache_dir`. Off by default so that a library imported
            into serving code or a notebook never fills a home directory unasked; turn it on to
            keep KV caches across restarts and share them between processes on one machine.
        disk_bytes: capacity of the disk tier (default 16 GiB).
        disk_policy: eviction order of the disk tier (``"lru"`` or ``"s3fifo"``).
        write_policy: how stores reach the disk tier: ``"write-through"`` (default: every chunk
            is queued for disk as it is stored in memory), ``"write-back"`` (only chunks evicted
            from memory go to disk) or ``"memory-only"`` (the disk tier is read, never written).
        disk_queue_bytes: bound of the asynchronous disk write queue; beyond it writes are dropped
            and counted, so ``store`` never waits for the disk (default 512 MiB).
        disk_read_threads: threads reading chunk files in parallel (default 4).
        disk_fsync: fsync each file before it is renamed into place (default True).
        pin_host_memory: once kdn serves a model on a CUDA device (the vLLM connector over GPU
            blocks, or an HF model read on the GPU), page-lock kdn's pooled host buffers (the memory
            tier's blobs, disk reads) as they are allocated, so that a hit's raw chunks go to the
            device by DMA straight from where the tier holds them (no host copy; the link's full
            speed). Default True; the locked bytes are the memory tier's and the pool's
            (``kdn._core.buffer_pool_stats()``): idle locked blocks are kept for one hit of the vLLM
            engine's longest prompt (``max_model_len``), or an HF model's largest hit so far (at most a
            quarter of the memory, unless ``KDN_BUFFER_POOL_BYTES`` caps them), so hits read from disk
            reuse them.
        remote_url: a Redis / Valkey store shared by processes and machines, or None (default):
            ``redis://[user:password@]host:port[/db]``, ``rediss://`` (TLS),
            ``redis+cluster://host:port`` (any node of a Redis Cluster), ``unix:///path``.
            Looked up after memory and disk; hits are promoted to the local tiers; stores are
            sent asynchronously (write-through).
            Another store's transport by its scheme: ``mooncake://master-host:rpc-port`` (Mooncake Store,
            :mod:`kdn.storage.mooncake_transport`).
        remote_options: settings of the remote store's transport (a mapping, or JSON text in
            ``KDN_REMOTE_OPTIONS``; kept as sorted ``(name, value)`` pairs), e.g. Mooncake's
            ``{"metadata_server": "http://host:8080/metadata"}``; checked against the transport's
            ``Options`` when the tiers are built.
        remote_timeout: seconds allowed for any call to the remote store (default 1.0).
        remote_ttl: seconds before the store expires a value; None (default) keeps it.
        remote_part_bytes: values above this are split into parts (default 16 MiB).
        remote_queue_bytes: bound of the asynchronous send queue; beyond it stores are dropped
            and counted (default 256 MiB).
        remote_retry_seconds: after a failure the store is skipped (no call waits on it) while a
            background thread probes it this often; the first probe that answers brings it back (default 5).
        memory_codec, disk_codec, remote_codec: the KV codec each tier stores chunks with
            (:mod:`kdn.codecs`): ``"raw"`` (default everywhere: exact and fastest), ``"lossless"``
            (bit-exact, smaller), or lossy ``"int8"``, ``"int4"``, ``"int2"``, ``"cachegen"``
            (``"cachegen:level=1..3"``), ``"kvtc"`` (``"kvtc:ratio=8"``; needs the model's calibration,
            :meth:`kdn.KDN.calibrate`). A typical split keeps memory raw and compresses what goes
            to disk and to the network. Disk encodes in its background writer, remote in its
            sender thread; a chunk read from a tier is re-coded to memory's codec when promoted.
        disk_shared: share the disk tier with other users of a group: files 0660 and directories
            2770 instead of 0600 / 0700, and a ``disk_dir`` owned by another user is accepted
            (default False: a private cache, and another user's directory is refused).
        secret: a passphrase (or ``$KDN_SECRET``) for tiers whose writers are not all trusted:
            disk files and remote values then carry a keyed BLAKE3 tag, verified on every read,
            so bytes written without the secret are misses. Never printed. Default None (plain
            XXH64 checksums: they catch corruption, not forgery).
        encrypt: store remote values encrypted (AES-256-GCM, ``pip install 'kdn[crypto]'``) under keys
            derived from ``secret`` and each chunk's key (so no two tenants share a key), with the
            value's name as associated data: a store's operator reads no KV, and a value moved
            under another name does not decrypt. Needs ``secret``; the key is never logged. Values
            are then read whole (no byte ranges). Default False.
        namespace: the tenant this process' KV belongs to (a string, e.g. a customer id): it enters the
            root of every key, so processes in different namespaces sharing tiers neither hit nor
            see each other's KV (vLLM's ``cache_salt`` and the facade's per-call ``namespace=``
            name one within it; in a config without a namespace, a call's ``"x"`` is the tenant a
            config's ``namespace="x"`` is). With a ``secret`` the keys also derive from it: tenants
            with different secrets neither see nor block each other. Default None (one shared space).
        accept_codecs: lossy codecs whose chunks this process may be served although it did not
            choose them for a tier (e.g. ``("int8", "cachegen:level=3")``, or a comma-separated
            string). Default ``()``: exact KV only, plus the lossy codecs of this process's own
            tiers. Lossy chunks are filed under their own keys (``kdn/codec.h``: ``lossy_key``), so
            a reader that wants exact KV misses a lossy writer's chunks and stores exact ones
            beside them, in every tier it shares.
        delivery: how a hit reaches the model. ``"layerwise"`` (default): chunks are fetched,
            verified and decoded one layer group at a time by worker threads while the model
            computes the layers already delivered (:mod:`kdn.delivery`; a remote tier streams byte
            ranges, so transfer overlaps compute). ``"whole"``: everything is laid out first.
            Models on a CUDA device are served whole.
        layer_group: layers per delivered group (default 3: SmolLM2's 30 layers in 10 groups); a
            value at or above the model's layer count delivers the whole model as one group (at most
            65536: larger values are refused as typos).
        ttft_deadline: seconds to first token that a remote hit aims for (None, default: no
            deadline, the exact KV is streamed). With a deadline, each layer group's level is
            picked from the bandwidth measured so far so that the deadline holds (the exact KV,
            then each of ``delivery_levels`` in order), and chunks that could not arrive in time
            are recomputed from their tokens instead (never slower than a full prefill, by the
            measured prefill speed). The levels served are in :meth:`kdn.KDN.stats` under
            ``"delivery"``.
        delivery_levels: lossy codec specs, best first, that chunks sent to the remote tier are
            also stored in for adaptive delivery (e.g. ``("cachegen:level=3", "cachegen:level=2",
            "cachegen:level=1", "int2")``). Default ``()``: exact KV only. KV served at a lossy
            level is never stored back as exact.
        verify_fraction: the fraction of hits, in [0, 1], whose last served tokens are recomputed
            and compared with what kdn stores (:mod:`kdn.engine.verify`): a mismatch is counted
            (``stats()["integrity"]``, ``vllm:kdn_verify_mismatches_total``), logged once with the
            chunk keys, and its chunks are dropped from every tier. Default 0 (off) in the library;
            **0.01 is the recommended value in production**: it watches a shared store's correctness
            for the cost of 16 recomputed tokens per hundred hits.
        retain_fraction, retain_max_seconds: the operator's bound on what requests may keep: a
            request's retention (the facade's ``retain=`` seconds, a vLLM request's
            ``kv_transfer_params={"kdn": {"retain": seconds}}``) pins its prompt in the memory tier for
            at most ``retain_max_seconds`` (default 3600), and is refused while pins would hold more
            than ``retain_fraction`` of the memory tier (default 0.25): no tenant pins the tier full.
        quotas: per-tenant bounds on the memory and disk tiers, ``{namespace: quota}``: a fraction of
            each tier (``0.25``) or a byte size (``"2GiB"``, capped at each tier's size). A tenant is a
            per-call ``namespace=`` of the facade, a vLLM request's ``cache_salt`` (without a LoRA
            adapter), for each model. A tenant at its quota evicts its own KV, least wanted first; in
            the eviction order each tenant with a quota is allowed its quota and the tenants without
            one share what is left fairly (a tier is shared fairly with no quota at all).
            ``KDN_QUOTAS="a=2GiB,b=0.25"`` in the environment.

    Sources, later wins: defaults, a YAML file, ``KDN_<FIELD>`` environment variables, keyword
    arguments (:meth:`load`).

    Example:
        >>> KDNConfig(chunk_size=128, memory_bytes="512MiB").memory_bytes
        536870912
        >>> from pathlib import Path
        >>> _ = Path("kdn.yaml").write_text("chunk_size: 128\\nmemory_bytes: 1GiB\\n")
        >>> config = KDNConfig.load("kdn.yaml", memory_policy="s3fifo")   # the file, then keywords
        >>> config.chunk_size, config.memory_bytes, config.memory_policy
        (128, 1073741824, 's3fifo')
    """

    chunk_size: int = 256
    probe_step: int = 16
    memory_bytes: int = 4 * GiB
    memory_policy: str = "lru"
    node_dir: str | None = None
    node_bytes: int = 8 * GiB
    disk_dir: str | None = None
    disk_bytes: int = 16 * GiB
    disk_policy: str = "lru"
    write_policy: str = "write-through"
    disk_queue_bytes: int = 512 * MiB
    disk_read_threads: int = 4
    disk_fsync: bool = True
    pin_host_memory: bool = True
    remote_url: str | None = None
    remote_timeout: float = 1.0
    remote_ttl: float | None = None
    remote_part_bytes: int = 16 * MiB
    remote_queue_bytes: int = 256 * MiB
    remote_retry_seconds: float = 5.0
    memory_codec: str = "raw"
    disk_codec: str = "raw"
    remote_codec: str = "raw"
    accept_codecs: tuple = ()
    delivery: str = "layerwise"
    layer_group: int = 3
    ttft_deadline: float | None = None
    delivery_levels: tuple = ()
    verify_fraction: float = 0.0
    retain_fraction: float = 0.25
    retain_max_seconds: float = 3600.0
    disk_shared: bool = False
    secret: str | None = dataclasses.field(default=None, repr=False)
    namespace: str | None = None
    encrypt: bool = False
    remote_options: tuple = ()
    quotas: tuple = ()

    def __post_init__(self):
        check(self)  # each field checked and normalized (kdn.config_checks)

    def __repr__(self) -> str:  # never print a password from remote_url
        fields = {**self.to_dict(), "remote_url": redact(self.remote_url) if self.remote_url else None,
                  "secret": "***" if self.secret is not None else None}
        return "KDNConfig(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_env(cls, **overrides) -> KDNConfig:
        """Defaults, then ``KDN_<FIELD>`` environment variables, then keyword overrides."""
        return cls(**{**sources.env_values(_field_names()), **overrides})

    @classmethod
    def from_yaml(cls, path, **overrides) -> KDNConfig:
        """Defaults, then the mapping in a YAML file (flat, or under a top-level ``kdn:``), then overrides."""
        return cls(**{**sources.yaml_values(path, _field_names()), **overrides})

    @classmethod
    def load(cls, path=None, **overrides) -> KDNConfig:
        """Defaults < YAML file (``path`` or ``$KDN_CONFIG``, if any) < ``KDN_*`` variables < overrides."""
        path = path if path is not None else os.environ.get("KDN_CONFIG")
        values = sources.yaml_values(path, _field_names()) if path else {}
        return cls(**{**values, **sources.env_values(_field_names()), **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def mac_key(self) -> bytes:
        """The 32-byte key of the keyed tags (derived from ``secret``), or b"" when there is none."""
        if self.secret is None:
            return b""
        from kdn import _core

        raw = self.secret.encode() if isinstance(self.secret, str) else bytes(self.secret)
        return _core.blake3(b"kdn/mac-key\0" + raw, 32)

    def tenant_key(self) -> bytes:
        """The key every chunk key's root derives from (:func:`kdn.keys.tenant_fingerprint`): the
        secret's (b"" without one), another when remote values are encrypted, so a store written
        sealed and one written tagged never share a name."""
        key = self.mac_key()
        if key and self.encrypt:
            from kdn import _core

            key = _core.blake3(b"kdn/sealed\0" + key, 32)
        return key

    def lossy_codecs(self) -> tuple:
        """The lossy codec specs whose chunks this process reads: its tiers' own, then ``accept_codecs``."""
        from kdn import codecs

        specs = (self.memory_codec, self.disk_codec, self.remote_codec, *self.accept_codecs)
        return tuple(dict.fromkeys(s for s in specs if codecs.parse(s).lossy))


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(KDNConfig)]


def _checked_init(init):
    """KDNConfig(unknown=...) is an InvalidInputError with a "did you mean", not a TypeError."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in kwargs:
            if name not in _field_names():
                raise sources.unknown(name, "KDNConfig(...)", _field_names())
        if len(args) > len(_field_names()):
            raise InvalidInputError(f"KDNConfig takes at most {len(_field_names())} settings, got {len(args)}")
        init(self, *args, **kwargs)

    return __init__


KDNConfig.__init__ = _checked_init(KDNConfig.__init__)
