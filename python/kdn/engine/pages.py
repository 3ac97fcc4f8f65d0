"""Pages a serving engine addresses by its own keys (SGLang HiCache's page hashes, no tokens): each
filed under a hash of the model's fingerprint and the engine's key, sealed and verified like any
blob kdn stores, in every tier the engine has (memory, disk, a remote store)."""

from __future__ import annotations

import logging

import torch

from kdn import _core
from kdn._core import BlobError, InvalidInputError

log = logging.getLogger("kdn")


class Pages:
    """The pages of one model (``fingerprint``, in the engine's tenant) under foreign keys
    (:meth:`kdn.engine.Engine.pages`). A page is the bytes of one tensor (whatever layout the
    serving engine keeps its pages in): what :meth:`save` is given, :meth:`load` writes back into a
    tensor of the same size, exactly, or not at all.

    Example:
        >>> pages = kdn.engine.Engine(kdn.KDNConfig()).pages(b"m" * 16)
        >>> pages.save(["page-a", "page-b"], [torch.arange(8.0), torch.ones(8)])
        2
        >>> pages.lookup(["page-a", "page-b", "page-c"])
        2
        >>> into = [torch.empty(8), torch.empty(8)]
        >>> pages.load(["page-a", "page-b"], into), into[0].tolist()[:3]
        (2, [0.0, 1.0, 2.0])
    """

    def __init__(self, tiers, fingerprint: bytes):
        self._tiers, self.fingerprint = tiers, fingerprint

    def address(self, key) -> bytes:
        """Where the page of foreign ``key`` (str or bytes) is filed for this model."""
        raw = key.encode() if isinstance(key, str) else bytes(key)
        return _core.blake3(b"kdn/page\0" + self.fingerprint + raw, 16)

    def lookup(self, keys: list) -> int:
        """How many leading ``keys`` have a page stored (reads no page)."""
        return self._tiers.count_prefix([self.address(k) for k in keys]) if keys else 0

    def held(self, keys: list) -> list[bool]:
        """Whether each of ``keys`` has a page stored."""
        return self._tiers.held([self.address(k) for k in keys]) if keys else []

    def load(self, keys: list, targets: list[torch.Tensor]) -> int:
        """Write the pages of the leading ``keys`` into ``targets`` (contiguous CPU tensors of the
        pages' sizes), read together; how many were loaded (a missing, foreign, damaged or
        wrongly sized page ends the run and is dropped when unusable)."""
        addresses = [self.address(k) for k in keys]
        blobs, _ = self._tiers.fetch(addresses, exact=True)
        for i, (blob, address, target) in enumerate(zip(blobs, addresses, targets)):
            try:
                data = _core.sidecar_read(blob, self.fingerprint, address)
            except BlobError as e:
                log.warning("kdn: dropping an unusable stored page (a miss): %s", e)
                self._tiers.drop(address)
                return i
            view = _bytes_of(target)
            if len(data) != len(view):
                log.warning("kdn: a stored page of %d bytes for a target of %d (a miss)", len(data), len(view))
                return i
            view[:] = data
        return len(blobs)

    def save(self, keys: list, sources: list[torch.Tensor]) -> int:
        """Store the page of each key (a CPU tensor's bytes); pages stored already are kept as
        they are. How many leading pages some tier now holds."""
        if len(keys) != len(sources):
            raise InvalidInputError(f"pages.save: {len(keys)} keys for {len(sources)} pages")
        addresses = [self.address(k) for k in keys]
        for address, source, held in zip(addresses, sources, self._tiers.held(addresses)):
            if not held and not self._tiers.put(address, _core.sidecar_pack(self.fingerprint, address,
                                                                             _bytes_of(source))):
                break
        return self.lookup(keys)

    def drop(self, keys: list) -> None:
        """Remove the pages of ``keys`` from every tier."""
        for address in (self.address(k) for k in keys):
            self._tiers.remove(address)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise InvalidInputError(f"pages: a contiguous CPU tensor is needed, got {tensor.device} "
                                f"{'contiguous' if tensor.is_contiguous() else 'strided'} {tuple(tensor.shape)}")
    return memoryview(tensor.detach().view(torch.uint8).reshape(-1).numpy())
