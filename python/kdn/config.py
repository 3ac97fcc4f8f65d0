"""KDNConfig: the settings of a KDN object, validated on construction."""

from __future__ import annotations

import dataclasses
import os

from kdn._core import InvalidInputError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class KDNConfig:
    """Settings of a :class:`kdn.KDN`.

    Attributes:
        chunk_size: tokens per stored chunk; prefix hits are whole chunks (default 256).
        memory_bytes: byte capacity of the host-memory tier (LRU eviction beyond it).

    Every field can also be set from the environment (``KDN_CHUNK_SIZE``, ``KDN_MEMORY_BYTES``)
    through :meth:`from_env`.

    Example:
        >>> KDNConfig(chunk_size=128, memory_bytes=512 << 20).chunk_size
        128
    """

    chunk_size: int = 256
    memory_bytes: int = 4 * GiB

    def __post_init__(self):
        for field in ("chunk_size", "memory_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"KDNConfig.{field} must be a positive integer, got {value!r}")
        if self.chunk_size > 1 << 20:
            raise InvalidInputError(f"KDNConfig.chunk_size={self.chunk_size} is too large (max 1048576)")

    @classmethod
    def from_env(cls, **overrides) -> KDNConfig:
        """Defaults, then ``KDN_<FIELD>`` environment variables, then keyword overrides."""
        values = {}
        for field in dataclasses.fields(cls):
            raw = os.environ.get(f"KDN_{field.name.upper()}")
            if raw is not None:
                try:
                    values[field.name] = int(raw)
                except ValueError:
                    raise InvalidInputError(f"KDN_{field.name.upper()}={raw!r} is not an integer") from None
        values.update(overrides)
        return cls(**values)
