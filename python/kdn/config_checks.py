"""KDNConfig's checks: every setting validated and normalized as a config is made (one typed error
naming the field and what it accepts), and the values they accept."""

from __future__ import annotations

import os
from pathlib import Path

from kdn import config_sources as sources
from kdn._core import InvalidInputError
from kdn.config_sources import INT_FIELDS, OPTIONAL_SECONDS, SECONDS_FIELDS, SIZE_FIELDS, check_namespace, parse_bytes
from kdn.urls import redact

WRITE_POLICIES = ("memory-only", "write-through", "write-back")
EVICTION_POLICIES = ("lru", "s3fifo")
DELIVERY_MODES = ("layerwise", "whole")
MAX_BYTES = 1 << 60  # 1 EiB: larger sizes are typos, and overflow the C++ stores' arithmetic
MAX_READ_THREADS = 64
MAX_LAYER_GROUP = 1 << 16  # more layers than any model has: larger values are typos


def default_cache_dir() -> Path:
    """Where ``disk_dir="auto"`` puts the disk tier: ``$XDG_CACHE_HOME/kdn`` or ``~/.cache/kdn``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kdn"


def default_node_dir() -> Path:
    """Where ``node_dir="auto"`` puts the node tier: ``/dev/shm/kdn-<uid>`` (shared memory)."""
    return Path("/dev/shm") / f"kdn-{os.geteuid()}"


def check(config) -> None:
    """Check every field of a :class:`kdn.KDNConfig` being made, normalizing sizes, fractions, codec
    specs, option pairs and folders in place; InvalidInputError naming the first bad field."""
    for name in SIZE_FIELDS:
        object.__setattr__(config, name, parse_bytes(getattr(config, name), f"KDNConfig.{name}"))
    for name in SIZE_FIELDS + INT_FIELDS:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidInputError(f"KDNConfig.{name} must be a positive integer, got {value!r}")
        if name in SIZE_FIELDS and value > MAX_BYTES:
            raise InvalidInputError(f"KDNConfig.{name}={value} is larger than 1 EiB; is it a typo?")
        if value < sources.MIN_BYTES.get(name, 0):
            raise InvalidInputError(f"KDNConfig.{name}={value}: at least {sources.MIN_BYTES[name]} bytes")
    if config.disk_read_threads > MAX_READ_THREADS:
        raise InvalidInputError(f"KDNConfig.disk_read_threads={config.disk_read_threads}: at most "
                                f"{MAX_READ_THREADS} (reads are bounded by the disk, not by threads)")
    if isinstance(config.probe_step, bool) or not isinstance(config.probe_step, int) or config.probe_step < 0:
        raise InvalidInputError(f"KDNConfig.probe_step must be a non-negative integer (0: whole-chunk hits only), "
                                f"got {config.probe_step!r}")
    if config.probe_step > 1 << 20:
        raise InvalidInputError(f"KDNConfig.probe_step={config.probe_step} is too large (max 1048576; values "
                                "above chunk_size act as chunk_size)")
    if config.layer_group > MAX_LAYER_GROUP:
        raise InvalidInputError(f"KDNConfig.layer_group={config.layer_group} is too large (max {MAX_LAYER_GROUP}; "
                                "a value at or above the model's layer count is one group)")
    for name in sources.FRACTION_FIELDS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            hint = " (0.01 is recommended in production)" if name == "verify_fraction" else ""
            raise InvalidInputError(f"KDNConfig.{name} must be a number in [0, 1]{hint}, got {value!r}")
        object.__setattr__(config, name, float(value))
    if config.chunk_size > 1 << 20:
        raise InvalidInputError(f"KDNConfig.chunk_size={config.chunk_size} is too large (max 1048576)")
    for name, choices in (("memory_policy", EVICTION_POLICIES), ("disk_policy", EVICTION_POLICIES),
                          ("write_policy", WRITE_POLICIES), ("delivery", DELIVERY_MODES)):
        if getattr(config, name) not in choices:
            raise InvalidInputError(f"KDNConfig.{name}={getattr(config, name)!r}; choose one of {', '.join(choices)}")
    if config.encrypt and config.secret is None:
        raise InvalidInputError("KDNConfig.encrypt=True needs a secret (its keys derive from it): set "
                                "KDNConfig.secret or $KDN_SECRET")
    for name in sources.BOOL_FIELDS:
        if not isinstance(getattr(config, name), bool):
            raise InvalidInputError(f"KDNConfig.{name} must be True or False, got {getattr(config, name)!r}")
    if config.namespace is not None:
        check_namespace(config.namespace, "KDNConfig.namespace")
    if config.secret is not None and (not isinstance(config.secret, (str, bytes)) or len(config.secret) < 8):
        raise InvalidInputError("KDNConfig.secret must be a string or bytes of at least 8 characters (or None)")
    for name in SECONDS_FIELDS:
        value = getattr(config, name)
        if value is None and name in OPTIONAL_SECONDS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise InvalidInputError(f"KDNConfig.{name} must be a positive number of seconds, got {value!r}")
        if value < sources.MIN_SECONDS.get(name, 0):
            raise InvalidInputError(f"KDNConfig.{name}={value!r}: at least {sources.MIN_SECONDS[name]} s")
    if config.remote_ttl is not None and config.remote_ttl < 0.001:
        raise InvalidInputError(f"KDNConfig.remote_ttl={config.remote_ttl!r}: at least 0.001 s (the store "
                                "expires values in milliseconds), or None to keep them")
    from kdn import codecs

    for name in ("memory_codec", "disk_codec", "remote_codec"):
        try:
            object.__setattr__(config, name, codecs.parse(getattr(config, name)).spec)
        except InvalidInputError as e:
            raise InvalidInputError(f"KDNConfig.{name}: {e}") from None
    for name in ("accept_codecs", "delivery_levels"):
        object.__setattr__(config, name, sources.codec_list(name, getattr(config, name)))
    for spec in config.delivery_levels:
        if not codecs.parse(spec).lossy:
            raise InvalidInputError(f"KDNConfig.delivery_levels: {spec!r} is exact; the exact level (remote_codec) "
                                    "is always first, list the lossy levels after it")
    object.__setattr__(config, "remote_options", sources.option_pairs(config.remote_options))
    object.__setattr__(config, "quotas", sources.quota_pairs(config.quotas))
    if config.remote_url is not None and (not isinstance(config.remote_url, str) or "://" not in config.remote_url):
        raise InvalidInputError("KDNConfig.remote_url must be a URL such as redis://127.0.0.1:6379/0 (its scheme "
                                f"is checked when the tiers are built), got {redact(str(config.remote_url))!r}")
    for name, auto in (("disk_dir", default_cache_dir), ("node_dir", default_node_dir)):
        value = getattr(config, name)
        if value is None:
            continue
        if not isinstance(value, (str, os.PathLike)) or str(value) == "":
            raise InvalidInputError(f"KDNConfig.{name} must be a path, 'auto' or None, got {value!r}")
        path = auto() if value == "auto" else Path(value).expanduser()
        object.__setattr__(config, name, str(path.absolute()))
    if config.node_dir is not None and config.node_dir == config.disk_dir:
        raise InvalidInputError("KDNConfig.node_dir and disk_dir are one folder; the node tier is shared memory "
                                "(a tmpfs folder), the disk tier a disk's")
