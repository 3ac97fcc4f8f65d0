"""How the remote tier frames a blob as store values: a keyed tag or AES-GCM sealing appended, and
values larger than ``part_bytes`` split into parts behind a manifest; read back, every frame is
checked before the blob's own checksum, so a planted value costs a bounded read and is a miss."""

from __future__ import annotations

import hmac
import struct

from kdn import _core
from kdn._core import BlobError

MANIFEST = struct.Struct("<4sIIQ")  # magic, format, parts, total bytes (the blob inside has its own checksum)
MANIFEST_MAGIC = b"KDNM"
TAG_BYTES = 32  # keyed mode: a BLAKE3 tag of the blob follows it in the value
MAX_VALUE_BYTES = 1 << 30  # no chunk kdn stores is larger: a manifest declaring more is not one it wrote


def part_names(name: str, parts: int) -> list[str]:
    """The names of a split value's parts (under the value's hash tag: one cluster slot)."""
    return [f"{name}:p{j}" for j in range(1, parts + 1)]


class Values:
    """Frames of format ``fmt``: values of at most ``part_bytes``, tagged with ``mac_key`` (when not
    empty) or sealed by ``sealer`` (a :class:`kdn.storage.sealing.Sealer`, when given)."""

    def __init__(self, fmt: int, part_bytes: int, mac_key: bytes, sealer=None):
        self.format, self.part_bytes, self._mac_key, self._sealer = fmt, part_bytes, mac_key, sealer

    @property
    def keyed(self) -> bool:
        """Whether values carry more than the blob (a tag, or sealing): no byte range of one is a blob's."""
        return bool(self._mac_key) or self._sealer is not None

    def seal(self, blob, key: bytes, name: str) -> list:
        """[value] or [manifest, part1, ...] for one blob filed under ``key`` as ``name``, as views of
        its bytes (no copies; one copy in keyed mode, where the blob's tag is appended, or sealed)."""
        data = memoryview(blob).cast("B")
        if self._sealer is not None:
            data = memoryview(self._sealer.seal(key, name, data))
        elif self._mac_key:
            data = memoryview(bytes(data) + _core.blake3(data, TAG_BYTES, key=self._mac_key))
        if len(data) <= self.part_bytes:
            return [data]
        parts = [data[i:i + self.part_bytes] for i in range(0, len(data), self.part_bytes)]
        return [MANIFEST.pack(MANIFEST_MAGIC, self.format, len(parts), len(data))] + parts

    def open(self, key: bytes, name: str, value):
        """A verified Buffer of the blob of chunk ``key`` from the value stored under ``name`` (bytes,
        or the list of its parts); raises :class:`BlobError` saying why it is unusable."""
        if not isinstance(value, list) and len(value) > self.part_bytes:
            raise BlobError(f"a value of {len(value)} bytes, more than this tier writes ({self.part_bytes})")
        if self._sealer is not None:
            value = self._sealer.open(key, name, value)
            if value is None:
                raise BlobError("does not decrypt (written without the secret, under another name, or altered)")
        elif self._mac_key:
            value = b"".join(value) if isinstance(value, list) else bytes(value)
            body, tag = value[:-TAG_BYTES], value[-TAG_BYTES:]
            if len(value) <= TAG_BYTES or not hmac.compare_digest(tag, _core.blake3(body, TAG_BYTES,
                                                                                     key=self._mac_key)):
                raise BlobError("keyed tag mismatch (written without the secret, or altered)")
            value = body
        if isinstance(value, list):
            blob = _core.buffer_join(value)
        else:  # a direct read is a Buffer already
            blob = value if isinstance(value, _core.Buffer) else _core.Buffer(value)
        header = _core.blob_parse(blob)  # checksum; marks the Buffer verified
        if header["key"] != key:
            raise BlobError("value belongs to another key")
        return blob

    def manifest(self, value) -> tuple[int, int] | None:
        """(parts, total bytes) of a split value's manifest, or None unless it is one this tier
        writes: its exact size, this format, a total no chunk exceeds, and exactly the parts that
        total splits into at ``part_bytes`` (so a planted manifest costs no memory and no time)."""
        if len(value) != MANIFEST.size:
            return None
        magic, fmt, parts, total = MANIFEST.unpack(bytes(value))
        if magic != MANIFEST_MAGIC or fmt != self.format or not self.part_bytes < total <= MAX_VALUE_BYTES:
            return None
        return (parts, total) if parts == -(-total // self.part_bytes) else None

    @staticmethod
    def join(total: int, parts: list):
        """The parts of a split value (joined later, in one copy), None if incomplete, b"" if bad."""
        if any(p is None for p in parts):
            return None  # incomplete (expired or evicted parts): a plain miss
        return parts if sum(len(p) for p in parts) == total else b""
