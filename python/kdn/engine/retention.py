"""What a request asks kdn to keep of the prompt it stores: pinned for a while, or an eviction priority."""

from __future__ import annotations

import dataclasses
import numbers

from kdn._core import InvalidInputError

PRIORITY_BOUND = 2**31 - 1  # the tiers keep a C int


@dataclasses.dataclass(frozen=True)
class Retention:
    """``seconds``: keep the prompt's stored chunks pinned in memory that long (None: no pin).
    ``priority``: where they stand in their tenant's eviction order in every local tier holding
    them (0 by default; a lower one leaves before the tenant's others, a higher one after them).
    A priority orders the tenant's own entries only, never another tenant's (fair sharing decides
    which tenant gives up bytes), and unlike a pin leaves an entry evictable. False when it asks
    nothing."""

    seconds: float | None = None
    priority: int = 0

    def __bool__(self) -> bool:
        return self.seconds is not None or self.priority != 0

    @classmethod
    def asked(cls, retain=None, priority=None) -> Retention:
        """A request's ``retain=`` seconds and ``priority=``, checked (InvalidInputError, one line)."""
        if retain is not None and (isinstance(retain, bool) or not isinstance(retain, numbers.Real) or not retain > 0):
            raise InvalidInputError(f"retain: a positive number of seconds, got {retain!r}")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, numbers.Integral)
                                     or abs(int(priority)) > PRIORITY_BOUND):
            raise InvalidInputError(f"priority: an integer within ±{PRIORITY_BOUND}, got {priority!r}")
        return cls(None if retain is None else float(retain), int(priority or 0))
