"""Layer-wise delivery: a prefix's chunks fetched, verified and decoded one layer group at a time
(remote chunks as byte ranges, at a level picked per group) while the model computes."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kdn import _core, codecs
from kdn._core import BlobError, KDNError
from kdn.engine.chunks import ChunkIO
from kdn.engine.plan import Estimates, Request, chunks_to_stream, layer_groups, level_for_group, level_of_chunk
from kdn.engine.session import ModelSession
from kdn.engine.targets import HFLayers

log = logging.getLogger("kdn")


class DeliveryError(KDNError):
    """Stored KV could not be delivered (the link failed mid-stream, a range failed its checksum).
    Raised by a streamed cache's layer that waits for it; :func:`kdn.integrations.hf.generate`
    then recomputes the prompt, so an answer is never lost."""


@dataclasses.dataclass
class _Level:
    """One stored coding of a remote chunk: its spec, the address it is filed under, the byte ranges
    of its sections (from its header) and, once a range of it is fetched, a buffer of its size."""

    spec: str
    address: bytes
    sections: list
    total: int
    prefix: bytes
    trailer: bytes
    buffer: object = None  # a pooled kdn Buffer of the blob's size, filled range by range
    view: memoryview | None = None

    def group_range(self, first: int, end: int) -> tuple[int, int]:
        """[begin, end) of layers [first, end): their planes are contiguous."""
        return self.sections[1 + 2 * first][0], self.sections[2 * end][1]

    def blob(self):
        if self.buffer is None:  # warm pooled pages, not zero-filled: only fetched ranges are ever read
            self.buffer = _core.host_array(self.total)
            self.view = memoryview(self.buffer)
            self.view[: len(self.prefix)] = self.prefix
            self.view[self.total - len(self.trailer):] = self.trailer
        return self.buffer


class LayerStream:
    """The layers of one hit arriving in the background into a target (default :class:`HFLayers`:
    ``2 * layers`` HF tensors of ``tokens`` tokens, :meth:`take_kv`), group by group; :meth:`wait`
    blocks until a layer is there.

    ``stats`` (after :meth:`wait_all`): hit tokens, chunks streamed and recomputed, the level of
    each group, bytes moved, measured bandwidth, seconds per stage.
    """

    def __init__(self, target, tokens: int, groups: list, run, stats: dict):
        self._target, self.tokens, self.groups = target, tokens, groups
        self.stats = stats
        self._done = [threading.Event() for _ in groups]
        self._group_of = {layer: i for i, (first, end) in enumerate(groups) for layer in range(first, end)}
        self._error: Exception | None = None
        # not a daemon: the interpreter waits for a stream at exit (bounded: decodes, socket timeouts)
        # instead of killing the thread inside a C++ decode, which aborts the process
        self._thread = threading.Thread(target=self._run, args=(run,), name="kdn-delivery", daemon=False)
        self._thread.start()

    def _run(self, run) -> None:
        try:
            run(self)
        except Exception as e:  # noqa: BLE001 - any failure ends the stream; waiters raise it
            self._error = e if isinstance(e, DeliveryError) else DeliveryError(f"{type(e).__name__}: {e}")
        finally:
            for event in self._done:
                event.set()

    def take_kv(self) -> list:
        """The tensors being filled (once: the stream then holds only its stats, so a finished
        stream kept for its stats does not keep the KV alive)."""
        target, self._target = self._target, None
        if target is None:
            raise KDNError("LayerStream.take_kv: the tensors were taken already")
        return target.kv

    def delivered(self, group: int) -> None:
        self._done[group].set()

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is in ``kv``; raises :class:`DeliveryError` if it never will be."""
        group = self._group_of[layer]
        self._done[group].wait()
        if self._error is not None and not self._group_ok(group):
            raise self._error

    def _group_ok(self, group: int) -> bool:
        return self.stats.get("groups_delivered", 0) > group

    def wait_all(self) -> None:
        """Block until every layer is delivered (raises :class:`DeliveryError` if one cannot be)."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    @property
    def failed(self) -> bool:
        return self._error is not None

    def delivered_all(self) -> bool:
        """Whether every layer group arrived (a failure after the last one served nothing wrong)."""
        return self.stats.get("groups_delivered", 0) >= len(self.groups)


class Deliverer:
    """Opens layer-wise streams of stored prefixes for one KDN (:class:`kdn.KDN` makes one).

    The chunks this machine holds (memory, disk) are read whole and verified as always; the chunks
    behind them that only the remote tier holds are streamed: one round trip reads the header,
    plane table and section sums of every chunk at every level (``KDNConfig.delivery_levels``),
    then each layer group is one pipelined round of byte ranges, verified by its section sums
    (blob format 2) and decoded by the C++ core (GIL released) into the cache tensors while the
    model computes the groups before it. With ``KDNConfig.ttft_deadline`` the level of each group
    is chosen from the bandwidth measured so far, and chunks that could not arrive in time are
    left to be recomputed from their tokens (:mod:`kdn.engine.plan`).
    """

    def __init__(self, chunks: ChunkIO, config):
        self.chunks, self.config = chunks, config
        self.estimates = Estimates()
        self.totals = {"streams": 0, "streamed_chunks": 0, "recomputed_chunks": 0, "bytes": 0, "failures": 0,
                       "levels": {}}
        self._lock = threading.Lock()

    def levels(self) -> list[str]:
        """Level specs, best first: the remote tier's own codec, then (with a deadline) the lossy levels."""
        remote = self.chunks.remote
        own = [remote.codec] if remote is not None else []
        return own + ([s for s in self.config.delivery_levels if s not in own]
                      if self.config.ttft_deadline is not None else [])

    def open(self, session: ModelSession, tokens: np.ndarray, limit: int, started: float | None = None,
             target=None, found=None, whole=None):
        """``(stream, hit)`` for the longest stored prefix of ``tokens`` (at most ``limit``), or
        ``(None, 0)`` on a miss; ``None`` alone when this prefix cannot be streamed (the caller
        reads it whole): a remote value split into parts, a keyed remote tier, version-1 blobs.
        ``target(hit)`` makes where the layers go (default :class:`HFLayers`); ``found``: what a
        lookup found (:meth:`kdn.engine.chunks.ChunkIO.find`), streamed without looking again;
        ``whole``: the load's whole target (``PagedBlocks``): the leading chunks it lays nothing from
        are not read (:meth:`kdn.engine.chunks.ChunkIO.unread`)."""
        started = time.perf_counter() if started is None else started
        found = self.chunks.find(session, tokens, limit) if found is None else found.clip(limit, session.chunk_size)
        if found.tokens == 0:
            return None, 0
        chunk = session.chunk_size
        skip = self.chunks.unread(whole, found, chunk)
        blobs, addresses, local_ok = self.chunks.fetch_verified(session, found, local=True, skip=skip)
        remote = self.chunks.remote
        remote_keys = found.keys[local_ok:]
        if remote_keys and (remote is None or not remote.range_readable):
            return None
        specs = self.levels()
        opened = self._open_remote(session, found, local_ok, specs) if remote_keys else []
        if opened is None:
            return None
        n = local_ok + len(opened)
        ends = [min((i + 1) * chunk, found.tokens) for i in range(n)]
        local_tokens = ends[local_ok - 1] if local_ok else 0
        groups = layer_groups(session.layout.layers, self.config.layer_group)
        sizes = [[None if lv is None else [lv.group_range(*g)[1] - lv.group_range(*g)[0] for g in groups]
                  for lv in chunk_levels] for chunk_levels in opened]
        request = Request(sizes, [e - s for s, e in zip([local_tokens] + ends[local_ok:], ends[local_ok:])],
                               local_tokens, len(tokens), self.config.ttft_deadline)
        k, why = chunks_to_stream(request, self.estimates, session.fingerprint, len(groups))
        opened, sizes = opened[:k], sizes[:k]
        hit = ends[local_ok + k - 1] if local_ok + k else 0
        if hit == 0 or local_ok + k <= skip:  # a miss, or none of what the target lays
            self._record({"recomputed_chunks": len(request.sizes), "why": why}, 0)
            return None, 0
        into = target(hit) if target is not None else HFLayers(session, hit)
        stats = {"hit_tokens": hit, "local_chunks": local_ok - skip, "skipped_chunks": skip, "streamed_chunks": k,
                 "recomputed_chunks": len(request.sizes) - k, "plan": why, "levels": [], "bytes": 0,
                 "deadline": self.config.ttft_deadline,
                 "lossy": any(a != k for a, k in zip(addresses, found.keys[skip:]))}  # grows as lossy groups arrive
        layers = session.layout.layers

        def fetch(g: int):
            """Pick group g's level, read its ranges, verify them: (chosen levels, bytes, seconds)."""
            first, end = groups[g]
            picked = self._pick_level(sizes, specs, g, len(groups), started, session, len(tokens) - hit, end - first)
            chosen = [chunk_levels[level_of_chunk(chunk_sizes, picked)]
                      for chunk_levels, chunk_sizes in zip(opened, sizes)]
            t0 = time.perf_counter()
            moved = self._fetch_group(chosen, first, end) if chosen else 0
            seconds = time.perf_counter() - t0
            if moved:
                self.estimates.observe_transfer(moved, seconds)
            return chosen, moved, seconds

        def run(stream: LayerStream) -> None:
            fetched = decoded = 0.0
            with ThreadPoolExecutor(1, thread_name_prefix="kdn-fetch") as pool:  # group g+1 arrives while g decodes
                pending = pool.submit(fetch, 0)
                for g, (first, end) in enumerate(groups):
                    chosen, moved, seconds = pending.result()
                    if g + 1 < len(groups):
                        pending = pool.submit(fetch, g + 1)
                    t1 = time.perf_counter()
                    group_blobs = list(blobs) + [lv.blob() for lv in chosen]  # from chunk `skip` on
                    try:
                        into.receive_layers(group_blobs, first, end, hit, layers)
                    except BlobError as e:  # a payload its checksum did not catch: never served
                        self.chunks.drop(list(addresses) + [lv.address for lv in chosen])
                        raise DeliveryError(f"undecodable stored chunks (dropped): {e}") from None
                    spent = time.perf_counter() - t1
                    if chosen:
                        self.estimates.observe_decode(chosen[0].spec, spent / (end - first))
                    decoded += spent
                    fetched += seconds
                    stats["levels"].append(chosen[0].spec if chosen else "local")
                    stats["lossy"] = stats["lossy"] or bool(chosen) and codecs.parse(chosen[0].spec).lossy
                    stats["bytes"] += moved
                    stats["groups_delivered"] = g + 1
                    stream.delivered(g)
            self._keep_whole(opened, stats)
            blobs.clear()
            opened.clear()
            stats.update(fetch_seconds=fetched, decode_seconds=decoded,
                         delivered_seconds=time.perf_counter() - started,
                         bandwidth_gbps=(self.estimates.bandwidth or 0) * 8e-9)
            self._record(stats, stats["bytes"])

        return LayerStream(into, hit, groups, run, stats), hit

    def _keep_whole(self, opened: list, stats: dict) -> None:
        """Chunks whose every layer group came from one level are whole blobs now: promote them
        into the local tiers, as a whole read would have (the next request finds them there)."""
        remote = self.chunks.remote
        if remote is None or not opened:
            return
        remote.count_streamed(len(opened))
        for chunk_levels in opened:
            used = [lv for lv in chunk_levels if lv is not None and lv.buffer is not None]
            if len(used) == 1:  # every group of this chunk came from that one level
                lv = used[0]
                lv.view.release()  # every section arrived and was verified: a whole blob, kept as it is
                self.chunks.keep(lv.address, lv.buffer, codecs.parse(lv.spec).lossy)

    # -- the remote part ------------------------------------------------------------------------
    def _open_remote(self, session: ModelSession, found, first: int, specs: list[str]):
        """Per remote chunk (from ``first`` on, in order, stopping at the first one no level has):
        its levels (``_Level`` per spec of ``specs``, or None where that level is not stored). None
        if some chunk cannot be streamed (the caller then reads whole)."""
        layout, chunk = session.layout, session.chunk_size
        remote = self.chunks.remote
        table = 80 + 8 * layout.layers  # header and the widest plane table
        trailer = 8 * (1 + 2 * layout.layers) + 8
        keys = found.keys[first:]
        requests = []
        for key in keys:
            for spec in specs:
                address = codecs.address(key, spec)
                requests += [(address, 0, table - 1), (address, -trailer, -1)]
        t0 = time.perf_counter()
        values = remote.read_ranges(requests)
        if values is None:
            return []
        self.estimates.observe_rtt(time.perf_counter() - t0)
        opened, unusable = [], []
        for c, key in enumerate(keys):
            index = first + c
            tokens = found.last_tokens if index == len(found.keys) - 1 and found.last_tokens else chunk
            levels = []
            for v, spec in enumerate(specs):
                prefix, tail = values[2 * (c * len(specs) + v)], values[2 * (c * len(specs) + v) + 1]
                if not remote.whole_value(prefix) or prefix[4:6] == b"\x01\x00":
                    return None  # split into parts by the store, or blob format 1 (no section sums): read whole
                levels.append(self._level(session, spec, codecs.address(key, spec), prefix, tail, index, tokens))
                if prefix and levels[-1] is None:
                    unusable.append(codecs.address(key, spec))
            if all(lv is None for lv in levels):
                break
            opened.append(levels)
        if unusable:  # a value under our name we cannot stream: the tier judges it whole (counted as corrupt,
            remote.get_many(unusable)  # remembered), so that this process' next store replaces it
        return opened

    @staticmethod
    def _level(session: ModelSession, spec: str, address: bytes, prefix: bytes, tail: bytes, index: int,
               tokens: int):
        if not prefix:
            return None
        layout = session.layout
        try:
            h = _core.blob_sections(prefix)
        except (BlobError, KDNError):
            return None
        expected = (session.fingerprint, address, layout.dtype, layout.layers, layout.kv_heads, layout.head_dim,
                    tokens, index * session.chunk_size, "kv")
        got = (h["fingerprint"], h["key"], h["dtype"], h["layers"], h["kv_heads"], h["head_dim"], h["tokens"],
               h["position"], h["kind"])
        trailer = h["trailer"][1] - h["trailer"][0]
        if got != expected or h["version"] < 2 or len(tail) != trailer:
            return None
        return _Level(spec, address, h["sections"], h["total_bytes"], prefix[: h["sections"][0][1]], tail)

    def _fetch_group(self, chosen: list, first: int, end: int) -> int:
        ranges = [lv.group_range(first, end) for lv in chosen]
        values = self.chunks.remote.read_ranges([(lv.address, b, e - 1) for lv, (b, e) in zip(chosen, ranges)])
        if values is None:
            raise DeliveryError("the remote tier failed mid-stream")
        moved = 0
        for lv, (b, e), value in zip(chosen, ranges, values):
            if len(value) != e - b:
                raise DeliveryError("a streamed chunk changed or vanished mid-stream")
            buffer = lv.blob()
            lv.view[b:e] = value
            try:
                _core.blob_verify_sections(buffer, 1 + 2 * first, 2 * end)
            except BlobError as e:  # damaged where it is stored (or on the way): dropped, so a store rewrites it
                self.chunks.drop([lv.address])
                raise DeliveryError(f"streamed KV failed its checksum (dropped): {e}") from None
            moved += e - b
        return moved

    def _pick_level(self, sizes, specs, group, groups, started, session, suffix_tokens, group_layers) -> int:
        if not sizes or self.config.ttft_deadline is None:
            return 0
        compute = self.estimates.prefill_seconds(session.fingerprint, suffix_tokens) or 0.0
        # the compute still ahead is not counted as hidden behind the transfer: on a small host the
        # two share the cores (2 cores, a 4K SmolLM2 hit at 10 Gbps: transfer 0.36 s + compute
        # 0.47 s took 0.81 s layer-wise, benchmarks/results/delivery)
        left = self.config.ttft_deadline - (time.perf_counter() - started) - compute * (groups - group) / groups
        decode = [self.estimates.decode_seconds(spec, group_layers) for spec in specs]
        return level_for_group(sizes, group, groups, left, self.estimates.bandwidth, decode)

    def _record(self, stats: dict, nbytes: int) -> None:
        with self._lock:
            t = self.totals
            t["streams"] += 1
            t["streamed_chunks"] += stats.get("streamed_chunks", 0)
            t["recomputed_chunks"] += stats.get("recomputed_chunks", 0)
            t["bytes"] += nbytes
            for spec in stats.get("levels", []):
                t["levels"][spec] = t["levels"].get(spec, 0) + 1

    def failed(self) -> None:
        with self._lock:
            self.totals["failures"] += 1

    def stats(self) -> dict:
        """Totals over this KDN's streams, and the current estimates."""
        with self._lock:
            return {**self.totals, "levels": dict(self.totals["levels"]),
                    "bandwidth_gbps": (self.estimates.bandwidth or 0) * 8e-9, "rtt_ms": (self.estimates.rtt or 0) * 1e3}
