"""Claims on a shared store: which engine is computing a chunk, as short leases its owner renews
(hints the engines sharing a :class:`kdn.storage.remote.RemoteTier` read; never a lock anyone waits
on when the store cannot tell)."""

from __future__ import annotations

import logging
import re

from kdn._core import InvalidInputError

log = logging.getLogger("kdn")

# a claim set to live longer than this (or forever), or whose owner is not a short printable name,
# was not written by kdn: ignored and removed
CLAIM_MAX_TTL_S = 60.0
_OWNER = re.compile(rb"[\x21-\x7e]{1,200}")


class Claims:
    """Claims filed through ``transport`` under names starting ``prefix``; each call runs through
    ``call(fn, default)`` (the tier's breaker and error accounting: ``default`` when the store cannot
    be used). ``bad``: claims kdn would not write, found and removed. With ``mac_key`` (a secret's,
    32 bytes) each claim carries a keyed tag of its name and owner: one written without the secret
    is not honoured (removed, counted as bad)."""

    def __init__(self, transport, prefix: str, call, mac_key: bytes = b""):
        self.transport, self._prefix, self._call, self._mac_key = transport, prefix, call, mac_key
        self.bad = 0

    def _value(self, name: str, owner: str) -> bytes:
        """What a claim of ``owner`` under ``name`` holds: the owner, and with a key its tag."""
        if not self._mac_key:
            return owner.encode()
        from kdn import _core

        tag = _core.blake3(b"kdn/claim\0" + name.encode() + b"\0" + owner.encode(), 16, key=self._mac_key)
        return owner.encode() + b" " + tag.hex().encode()

    def _owner(self, name: str, held: bytes) -> str | None:
        """The owner a stored claim value names, if kdn (with this tier's key) wrote it."""
        owner = held.split(b" ", 1)[0] if self._mac_key else held
        if not _OWNER.fullmatch(owner):
            return None
        return owner.decode() if self._value(name, owner.decode()) == held else None

    def name(self, key: bytes) -> str:
        return f"{self._prefix}claim:{key.hex()}"

    def claim(self, key: bytes, owner: str, ttl: float, also=()) -> bool | None:
        """Record for ``ttl`` seconds (a lease its owner renews, :meth:`renew`) that ``owner`` is
        computing chunk ``key``, unless another owner's claim is live. True: ``owner`` holds it;
        False: another owner does; **None: cannot tell** (the store cannot be used now): the caller
        computes, as without claims — an outage never makes anyone wait; always None on a store whose
        values cannot expire (``supports_ttl``). Atomic where the
        transport ``supports_put_if_absent`` (of two owners claiming at once, one wins); else a
        hint two racing owners may both win. A claim kdn would not write (no TTL, a TTL above
        ``CLAIM_MAX_TTL_S``, an owner that is not a short printable name) is removed and ignored.
        ``also``: the chunks the owner computes after ``key``, claimed with it when it wins (an
        engine whose lookup sees the first of them stored while the rest are on their way then
        waits for the rest instead of computing them again)."""
        if not _OWNER.fullmatch(owner.encode()) or not 0 < ttl <= CLAIM_MAX_TTL_S:
            raise InvalidInputError(f"claim: owner must be 1-200 printable ASCII characters and ttl in "
                                    f"(0, {CLAIM_MAX_TTL_S:g}] s, got {owner!r}, {ttl!r}")
        if not self.transport.supports_ttl:  # a lease that cannot expire would outlive a crashed owner
            return None
        name = self.name(key)
        ttl_ms = max(1, round(ttl * 1000))

        def run():
            won = self.transport.supports_put_if_absent and self.transport.put_if_absent(
                name, self._value(name, owner), ttl_ms)
            if not won:
                held = self._live_claim(name)
                if held is not None and held != owner:
                    return False
            rest = [] if won else [name]  # renewed by its owner (or a plain write)
            if rest or also:
                self.transport.put([(n, self._value(n, owner)) for n in rest + [self.name(k) for k in also]], ttl_ms)
            return True

        return self._call(run, None)

    def _live_claim(self, name: str) -> str | None:
        """The owner of the claim under ``name`` if it is one kdn honours, else None (a claim kdn
        would not write is deleted, counted as ``bad_claims``)."""
        held = self.transport.get([name])[0]
        if held is None:
            return None
        held = bytes(memoryview(held))
        left = self.transport.expiry([name])[0]
        if left == -2:  # expired since it was read
            return None
        owner = self._owner(name, held)
        if owner is not None and (left is None or 0 < left <= CLAIM_MAX_TTL_S * 1000):
            return owner
        self.bad += 1
        if self.bad == 1:
            log.warning("kdn remote tier: removed a claim kdn would not write (%s, %s ms to live); claims are "
                        "leases of at most %g s", "a claim of this tier" if owner is not None else
                        "an owner or tag this tier did not write", left, CLAIM_MAX_TTL_S)
        self.transport.delete([name])
        return None

    def renew(self, keys: list[bytes], owner: str, ttl: float) -> bool:
        """Extend ``owner``'s claims on ``keys`` by ``ttl`` seconds, in one round trip (a plain
        write: claims are hints); False when the store cannot be used."""
        if not keys or not self.transport.supports_ttl:
            return True  # nothing claimed on a store whose values cannot expire
        ttl_ms = max(1, round(min(ttl, CLAIM_MAX_TTL_S) * 1000))
        items = [(self.name(k), self._value(self.name(k), owner)) for k in keys]
        return bool(self._call(lambda: self.transport.put(items, ttl_ms) or True, False))

    def claimant(self, key: bytes) -> str | None:
        """The owner of a live claim on chunk ``key``, or None (none, one kdn ignores, or the store is down)."""
        return self._call(lambda: self._live_claim(self.name(key)), None)

    def release(self, key: bytes, owner: str) -> None:
        """Drop ``owner``'s claim on ``key`` (another owner's is left alone)."""
        if self.claimant(key) == owner:
            self._call(lambda: self.transport.delete([self.name(key)]), None)
