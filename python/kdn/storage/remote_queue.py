"""The remote tier's send queue: blobs waiting for the store, bounded by bytes, sent in batches by a
thread of its own, so that a store never waits on the network."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

BATCH_BYTES = 32 << 20  # what one send carries at most (pipelined in one round trip)


class SendQueue:
    """Blobs queued for ``send(blobs)`` (called from the queue's thread, in order, in batches of at most
    :data:`BATCH_BYTES`), at most ``capacity`` bytes waiting: :meth:`put` refuses what does not fit, or
    everything while ``open()`` says the store is skipped."""

    def __init__(self, send: Callable[[list], object], capacity: int, open: Callable[[], bool]):  # noqa: A002
        self._send, self.capacity, self._open = send, capacity, open
        self._queue: collections.deque = collections.deque()
        self._bytes, self._sending = 0, False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="kdn-remote-writer", daemon=True)
        self._thread.start()

    def put(self, blob) -> bool:
        """Queue ``blob``; False (nothing queued) when it does not fit or the store is skipped."""
        size = len(blob)
        with self._cv:
            if not self._open() or self._bytes + size > self.capacity:
                return False
            self._queue.append(blob)
            self._bytes += size
            self._cv.notify()
        return True

    def wait_sent(self, timeout: float | None = None) -> bool:
        """Wait until every queued blob has been sent (or dropped by ``send``); True if it was."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._sending, timeout)

    def waiting(self) -> tuple[int, int]:
        """``(blobs, bytes)`` queued now."""
        with self._cv:
            return len(self._queue), self._bytes

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                batch, size = [], 0
                while self._queue and size < BATCH_BYTES:
                    batch.append(self._queue.popleft())
                    size += len(batch[-1])
                self._sending = True
            try:
                self._send(batch)
            finally:
                with self._cv:
                    self._bytes -= size
                    self._sending = False
                    self._cv.notify_all()
