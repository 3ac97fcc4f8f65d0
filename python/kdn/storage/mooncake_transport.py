"""The Mooncake Store transport: kdn's remote tier over a Mooncake distributed store (its master and
metadata server; every client mounts a segment of its memory into the store's pool), reading
values straight into kdn's pooled Buffers and writing them from the values' own memory."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from kdn import _core
from kdn._core import InvalidInputError
from kdn.config_sources import MiB
from kdn.storage.base import at_exit
from kdn.storage.transport import RemoteTransport, register

_MISSING = -704  # Mooncake's OBJECT_NOT_FOUND
MAX_IN_FLIGHT = 16  # calls waiting on the store at once
RPC_TIMEOUT_S = 30.0  # how long Mooncake's own calls wait on a master that does not answer
INSTALL = ("the mooncake:// store needs Mooncake's client: pip install mooncake-transfer-engine-non-cuda "
           "(and, on Debian, apt-get install libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4)")


@register
class MooncakeTransport(RemoteTransport):
    """``mooncake://master-host:rpc-port``: a Mooncake Store whose master listens there.

    The pool's memory is lent by Mooncake clients that outlive kdn's processes (``mooncake_client
    --global_segment_size=...``, one per machine that serves the store); kdn lends none by default
    (``Options.global_segment_bytes``: values placed in a lent segment vanish with its process).

    Each call runs on a thread of its own and is answered within the remote timeout: Mooncake's
    own calls wait up to 30 s for a master that stopped answering (90 s to connect to none), and
    kdn's remote tier must never stall a request on its store. A call that times out is a failure
    (the tier's breaker then skips the store and probes it; at most ``MAX_IN_FLIGHT`` calls wait
    at once). Mooncake's ``setup`` holds the GIL while it waits for a master, so it runs only after
    the master's port and metadata server answered. Mooncake keeps no expiry and cannot list its
    names, so claims are off and ``remote_ttl`` is refused; values it evicts are plain misses. Not
    range-readable: remote chunks load whole.
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        metadata_server: str | None = None  # default: the master's HTTP metadata server, http://host:8080/metadata
        local_hostname: str = "127.0.0.1"  # how other clients reach this one's segment
        protocol: str = "tcp"  # or "rdma" (with rdma_devices)
        rdma_devices: str = ""
        global_segment_bytes: int = 0  # memory this process lends the pool (its values vanish when it exits)
        local_buffer_bytes: int = 64 * MiB  # this client's transfer buffer

    schemes = ("mooncake",)
    supports_scan = False

    def __init__(self, url: str, timeout: float, options: Options | None = None):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise InvalidInputError(f"{INSTALL} ({e})") from None
        parts = urllib.parse.urlsplit(url)
        if not parts.hostname or not parts.port:
            raise InvalidInputError(f"remote_url={url!r}: expected mooncake://master-host:rpc-port")
        self.options = options or self.Options()
        self.master = f"{parts.hostname}:{parts.port}"
        self.metadata = self.options.metadata_server or f"http://{parts.hostname}:8080/metadata"
        self.timeout = timeout
        self._new_store = MooncakeDistributedStore
        self._store = None
        self._setup: concurrent.futures.Future | None = None
        self._lock = threading.Condition()
        self._in_flight, self._closing = 0, False
        at_exit(self, "drain")

    # -- calls, each answered within the timeout ------------------------------------------------
    def _connect(self):
        self._probe()  # Mooncake's setup holds the GIL while it waits for a master (90 s for none)
        store = self._new_store()
        o = self.options
        rc = store.setup(o.local_hostname, self.metadata, o.global_segment_bytes, o.local_buffer_bytes, o.protocol,
                         o.rdma_devices, self.master)
        if rc != 0:
            raise ConnectionError(f"Mooncake setup with master {self.master} failed ({rc})")
        return store

    def _probe(self) -> None:
        """Raise unless the master's RPC port accepts and its metadata server answers (any HTTP
        status) within the timeout: a master that is down, or up and silent."""
        host, port = self.master.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=self.timeout):
            pass
        try:
            urllib.request.urlopen(f"{self.metadata}?key=kdn%2Fprobe", timeout=self.timeout).close()
        except urllib.error.HTTPError:
            pass  # it answered

    def _client(self):
        """The connected store, connecting once (in the background: a setup that waits for a master
        outlives the call that started it, and the next call after it failed starts another)."""
        with self._lock:
            if self._store is not None:
                return self._store
            if self._setup is None or (self._setup.done() and self._setup.exception() is not None):
                self._setup = _submit(self._connect)
            setup = self._setup
        store = self._wait(setup)
        with self._lock:
            self._store = store
        return store

    def _wait(self, future: concurrent.futures.Future):
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"Mooncake master {self.master} did not answer within {self.timeout:g} s") from None

    def _run(self, fn):
        store = self._client()
        with self._lock:
            if self._closing:
                raise ConnectionError("the process is exiting: no new Mooncake calls")
            if self._in_flight >= MAX_IN_FLIGHT:  # calls stuck on a silent master: do not pile up more
                raise TimeoutError(f"Mooncake master {self.master}: {self._in_flight} calls still unanswered")
            self._in_flight += 1

        def call():
            try:
                return fn(store)
            finally:
                with self._lock:
                    self._in_flight -= 1
                    self._lock.notify_all()

        return self._wait(_submit(call))

    # -- the transport ------------------------------------------------------------------------------
    def ping(self) -> None:
        """The master's port and metadata server answer (checked without entering Mooncake, whose
        calls would wait on a dead or silent master), then one round trip to it (its own
        ``health_check`` does not notice a silent master)."""
        self._probe()
        self.exists(["kdn:ping"])

    def exists(self, names: list[str]) -> list[bool]:
        found = self._run(lambda store: store.batch_is_exist(names))
        if any(f < 0 for f in found):
            raise ConnectionError(f"Mooncake batch_is_exist failed ({min(found)})")
        return [f == 1 for f in found]

    def get(self, names: list[str]) -> list:
        """Each value read straight into a pooled Buffer of its size (sizes from the master first);
        a value above ``max_value_bytes`` is not read (returned empty: the tier counts it corrupt)."""
        limit = self.max_value_bytes

        def run(store):
            sizes = {name: replicas[0].get_memory_descriptor().buffer_descriptor.size
                     for name, replicas in store.batch_get_replica_desc(names).items()
                     if replicas and replicas[0].is_memory_replica()}
            wanted = [n for n in names if n in sizes and (limit is None or sizes[n] <= limit)]
            buffers = [_core.host_array(sizes[n]) for n in wanted]
            got = store.batch_get_into(wanted, [_address(b) for b in buffers], [len(b) for b in buffers]) \
                if wanted else []
            read = {}
            for name, buf, n in zip(wanted, buffers, got):
                if n == len(buf):
                    buf.freeze()
                    read[name] = buf
                elif n != _MISSING:  # (evicted since its size was read: a plain miss)
                    raise ConnectionError(f"Mooncake batch_get_into failed ({n})")
            # a value too large is not read: empty, which the tier counts as a corrupt miss
            return [read[n] if n in read else b"" if n in sizes and n not in wanted else None for n in names]

        return self._run(run)

    def put(self, items: list[tuple[str, object]], ttl_ms: int | None) -> None:
        """Write (insert or replace) each value from its own memory; ``ttl_ms`` cannot be kept."""
        views = [memoryview(v).cast("B") for _, v in items]

        def run(store):
            names, addresses = [n for n, _ in items], [_address(v) for v in views]
            codes = store.batch_upsert_from(names, addresses, [len(v) for v in views])
            if any(c != 0 for c in codes):
                raise ConnectionError(f"Mooncake batch_upsert_from failed ({min(codes)})")

        self._run(run)

    def delete(self, names: list[str]) -> int:
        return sum(code == 0 for code in self._run(lambda store: store.batch_remove(names, True)))

    def delete_matching(self, pattern: str) -> None:
        regex = "^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$"
        self._run(lambda store: store.remove_by_regex(regex, True))

    def drain(self, timeout: float | None = None) -> None:
        """At exit: start no more calls, and wait until those inside Mooncake have ended (a thread
        inside Mooncake when the process exits aborts it); as long as Mooncake's own calls wait."""
        with self._lock:
            self._closing = True
            self._lock.wait_for(lambda: self._in_flight == 0, timeout=max(timeout or 0.0, RPC_TIMEOUT_S + 5))

    def close(self) -> None:
        """Unmount this client's segment and disconnect (values in other clients' segments stay)."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            self._wait(_submit(store.close))


def _submit(fn, *args) -> concurrent.futures.Future:
    """Run ``fn(*args)`` on a daemon thread of its own (a call stuck on a silent master neither
    holds a caller past its timeout nor the interpreter at exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            future.set_exception(e)

    threading.Thread(target=run, name="kdn-mooncake", daemon=True).start()
    return future


def _address(data) -> int:
    """The address of a bytes-like object's memory (the object must outlive the call using it)."""
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data) if len(data) else 0
