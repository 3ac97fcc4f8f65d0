"""A remote tier's event log (:meth:`kdn.storage.Tier.take_events`): the blobs this process filed in
the shared store, and their removal when the store evicts, expires or deletes them, whoever asked,
told by the store itself (:meth:`kdn.storage.transport.RemoteTransport.watch_removals`).

Each process announces what it wrote, so a fleet announces each remote chunk once (by its writer),
not once per engine; a blob another process wrote first is not announced here (this process found it
there and sent nothing). A store that cannot tell its removals (Mooncake's) has only this process's
own deletes announced, and ``watching`` says so.
"""

from __future__ import annotations

import collections
import threading

KNOWN = 1 << 18  # filed blobs remembered for their removal (least recent forgotten)


class RemoteEvents:
    """``(stored, address)`` events of one remote tier, in order."""

    def __init__(self, transport):
        self._lock = threading.Lock()
        self._filed: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._log: list[tuple[bool, bytes]] = []
        self._watch = transport.watch_removals(self._on_removed)
        self.watching = self._watch is not None

    def filed(self, keys) -> None:
        """This process wrote ``keys`` to the store (each announced once until it is removed)."""
        with self._lock:
            for key in keys:
                if key not in self._filed:
                    self._log.append((True, key))
                self._filed[key] = None
                self._filed.move_to_end(key)
            while len(self._filed) > KNOWN:
                self._filed.popitem(last=False)

    def removed(self, key: bytes) -> None:
        """This process removed ``key`` (told by the store instead when it is ``watching``)."""
        if not self.watching:
            self._forget(key)

    def cleared(self) -> None:
        if not self.watching:
            with self._lock:
                self._log += [(False, key) for key in self._filed]
                self._filed.clear()

    def _on_removed(self, name: str) -> None:
        start, end = name.find("{"), name.find("}")
        if 0 <= start < end and end - start == 33:  # kdn:<format>:{<32 hex digits>}[:p<j>]
            try:
                self._forget(bytes.fromhex(name[start + 1:end]))
            except ValueError:
                pass

    def _forget(self, key: bytes) -> None:
        with self._lock:
            if self._filed.pop(key, 0) is None:
                self._log.append((False, key))

    def take(self) -> list[tuple[bool, bytes]]:
        with self._lock:
            out, self._log = self._log, []
        return out

    def sync(self, timeout: float = 1.0) -> bool:
        """Wait until the store's removals so far have been told (True at once when not watching)."""
        return self._watch.sync(timeout) if self._watch is not None else True

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
