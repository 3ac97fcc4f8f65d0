"""The remote tier's circuit breaker: a store that fails is skipped until a background probe finds it back."""

from __future__ import annotations

import logging
import threading
import time

from kdn.urls import redact

log = logging.getLogger("kdn")


class Breaker:
    """Circuit breaker: after a failure every call is skipped (no caller waits on a store that is
    down) while a background thread probes the store every ``retry_seconds``; the first probe that
    succeeds closes it. So an outage costs the callers one timeout, not one per ``retry_seconds``."""

    def __init__(self, url: str, retry_seconds: float, probe):
        self.url, self.retry_seconds, self._probe = url, retry_seconds, probe
        self.down_since = None
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return self.down_since is None

    def failure(self, error: Exception) -> None:
        with self._lock:
            if self.down_since is not None:
                return
            self.down_since = time.monotonic()
        log.warning("kdn remote tier %s unreachable (%s: %s); lookups miss and stores are dropped, "
                    "probing every %.0f s", redact(self.url), type(error).__name__, error, self.retry_seconds)
        threading.Thread(target=self._probe_until_back, name="kdn-remote-probe", daemon=True).start()

    def _probe_until_back(self) -> None:
        while True:
            time.sleep(self.retry_seconds)
            try:
                self._probe()
            except Exception:  # still down (or refusing): probe again later
                continue
            self.success()
            return

    def success(self) -> None:
        with self._lock:
            since, self.down_since = self.down_since, None
        if since is not None:
            log.warning("kdn remote tier %s is back after %.1f s", redact(self.url), time.monotonic() - since)

    @property
    def state(self) -> str:
        return "ok" if self.down_since is None else "down"
