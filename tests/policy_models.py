"""Plain-Python reference models of the eviction policies the C++ tiers must follow exactly."""

from __future__ import annotations

import collections


class ReferenceLRU:
    def __init__(self, capacity):
        self.capacity, self.order = capacity, collections.OrderedDict()  # first = least recent

    def insert(self, key, size):
        self.order[key] = size

    def touch(self, key):
        if key in self.order:
            self.order.move_to_end(key)

    def erase(self, key):
        self.order.pop(key, None)

    def pop_victim(self):
        return self.order.popitem(last=False)[0] if self.order else None


class ReferenceS3FIFO:
    """S3-FIFO as documented in csrc/include/kdn/eviction.h (small 10%, main, ghost, 2-bit counter)."""

    def __init__(self, capacity):
        self.small_target, self.ghost_limit = max(1, capacity // 10), capacity - capacity // 10
        self.small, self.main = collections.OrderedDict(), collections.OrderedDict()  # key -> [size, freq]
        self.ghost = collections.deque()  # (key, size, seq), left = newest
        self.ghost_seq, self.seq = {}, 0

    def insert(self, key, size):
        self.erase(key)
        queue = self.main if self.ghost_seq.pop(key, None) is not None else self.small
        queue[key] = [size, 0]

    def touch(self, key):
        for q in (self.small, self.main):
            if key in q:
                q[key][1] = min(q[key][1] + 1, 3)

    def erase(self, key):
        self.small.pop(key, None)
        self.main.pop(key, None)

    def _bytes(self, q):
        return sum(size for size, _ in q.values())

    def pop_victim(self):
        while True:
            if self.small and (self._bytes(self.small) >= self.small_target or not self.main):
                key, (size, freq) = self.small.popitem(last=False)  # oldest
                if freq > 0:
                    self.main[key] = [size, 0]
                    continue
                self.seq += 1
                self.ghost.appendleft((key, size, self.seq))
                self.ghost_seq[key] = self.seq
                while sum(s for _, s, _ in self.ghost) > self.ghost_limit and self.ghost:
                    old, _, seq = self.ghost.pop()
                    if self.ghost_seq.get(old) == seq:
                        del self.ghost_seq[old]
                return key
            if not self.main:
                return None
            key, entry = next(iter(self.main.items()))
            if entry[1] > 0:
                entry[1] -= 1
                self.main.move_to_end(key)
                continue
            del self.main[key]
            return key


class ReferenceTier:
    """A tier over a reference policy: sizes, pins and capacity as kdn/tier_index.h specifies."""

    def __init__(self, capacity, policy):
        self.capacity = capacity
        self.policy = {"lru": ReferenceLRU, "s3fifo": ReferenceS3FIFO}[policy](capacity)
        self.sizes, self.pinned = {}, set()

    @property
    def used(self):
        return sum(self.sizes.values())

    def put(self, key, size):
        was_pinned = key in self.pinned
        if key in self.sizes:
            self._erase(key)
        pinned_bytes = sum(self.sizes[k] for k in self.pinned)
        if size > self.capacity - pinned_bytes:
            return False
        while self.used + size > self.capacity:
            del self.sizes[self.policy.pop_victim()]
        self.sizes[key] = size
        self.policy.insert(key, size)
        if was_pinned:
            self.pin(key)
        return True

    def get(self, key):
        if key in self.sizes:
            self.policy.touch(key)
            return True
        return False

    def _erase(self, key):
        if key in self.pinned:
            self.pinned.discard(key)
        else:
            self.policy.erase(key)
        del self.sizes[key]

    def pin(self, key):
        if key not in self.sizes:
            return False
        if key not in self.pinned:
            self.policy.erase(key)
            self.pinned.add(key)
        return True

    def unpin(self, key):
        if key not in self.pinned:
            return False
        self.pinned.discard(key)
        self.policy.insert(key, self.sizes[key])
        return True
