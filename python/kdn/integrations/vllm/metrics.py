"""The vLLM connector's counters and latency histograms: this process' totals, the increments vLLM
collects from both connector halves each interval (it sums them), and their Prometheus metrics:
counters ``vllm:kdn_<name>`` and histograms ``vllm:kdn_<lookup|load|store|tier_read>_duration_seconds``."""

from __future__ import annotations

import collections
import threading
import time

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

NAMES = ("lookups", "hit_tokens", "loads", "loaded_tokens", "load_errors",
         # positions laid into the blocks, summed over layers (a sliding layer's: its window only)
         "loaded_layer_tokens", "stores", "stored_tokens",
         "refused_stores", "verify_checks", "verify_mismatches",
         # where the time goes: the scheduler's lookups (its thread), loads into the blocks and gathers
         # of finished prompts out of them (the engine's thread, between forwards), the forward waiting
         # for layers a layer-wise load had not laid in yet, stores (the store thread: wall time, its
         # CPU time, and the wall time spent waiting on the tiers' writes)
         "lookup_seconds", "load_seconds", "gather_seconds", "layer_wait_seconds", "store_seconds",
         "store_cpu_seconds", "flush_seconds",
         # a whole load's seconds split (LoadClock): an async load waiting for the load thread,
         # the host (lookup, reads, checks, queueing copies), a GPU's stream running its copies
         "load_queue_seconds", "load_host_seconds", "load_device_seconds",
         # chunks each tier served to this process' loads (from the tiers' own counters)
         "memory_chunks", "node_chunks", "disk_chunks", "remote_chunks",
         # requests that waited for another's prefill of their document (asked again later); waits
         # ended because another engine's claim made no progress for Requests.progress_leases leases
         "in_flight_waits", "stalled_claims",
         # chunks kept pinned as requests asked (kv_transfer_params retain), and retentions refused by
         # the operator's bound (retain_fraction)
         "retained_chunks", "refused_retentions",
         # blending (requests that named passages): requests served a blended span, its tokens, the
         # tokens the selective recompute computed again (summed over layers), its seconds, and the
         # passages computed on their own and stored as segments for the next request
         "blends", "blended_tokens", "recomputed_layer_tokens", "blend_seconds", "stored_passages",
         # disaggregated prefill (kv_consumer): requests that waited for their prefiller's store, and
         # waits that ended at prefill_wait_s with less of it stored (the rest computed)
         "prefill_waits", "prefill_wait_timeouts")

# Histograms, in Prometheus's conventions (seconds; ``_bucket``, ``_sum``, ``_count``): each lookup,
# load and store the counters above time (one ``count`` call each), and each batched read of one tier
# (``tier`` label). Their observations travel in an interval's data as lists under ``<counter>:samples``
# and ``tier_read_seconds:<tier>``, at most SAMPLES of each per interval (the latest).
HISTOGRAMS = {"lookup_seconds": "vllm:kdn_lookup_duration_seconds", "load_seconds": "vllm:kdn_load_duration_seconds",
              "store_seconds": "vllm:kdn_store_duration_seconds"}
TIER_READS = "vllm:kdn_tier_read_duration_seconds"
TIERS = ("memory", "node", "disk", "remote")
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SAMPLES = 4096

_lock = threading.Lock()
_totals = dict.fromkeys(NAMES, 0)
_reported = dict(_totals)  # what increments() last handed out
_samples = {name: collections.deque(maxlen=SAMPLES) for name in HISTOGRAMS}  # observations not handed out yet


def count(**deltas) -> None:
    """Add to this process' counters (a histogram's counter, ``lookup_seconds`` say, is one observation)."""
    with _lock:
        for name, value in deltas.items():
            _totals[name] += value
            if name in _samples:
                _samples[name].append(value)


def totals() -> dict:
    """This process' counters."""
    with _lock:
        return dict(_totals)


def increments(absolute: dict, reads: dict | None = None) -> dict:
    """Each counter's increase since the last call, after setting those given as ``absolute`` values
    (the tiers' served counts), with the histograms' observations since (``reads``: ``{tier: [seconds]}``
    of the tiers' batched reads); in one process the first caller takes them and the next finds none."""
    with _lock:
        _totals.update(absolute)
        delta = {name: _totals[name] - _reported[name] for name in NAMES}
        _reported.update(_totals)
        for name, observed in _samples.items():
            if observed:
                delta[f"{name}:samples"] = list(observed)
                observed.clear()
    for tier, seconds in (reads or {}).items():
        if seconds:
            delta[f"tier_read_seconds:{tier}"] = list(seconds[-SAMPLES:])
    return delta


class LoadClock:
    """Where one load's seconds go (the connector's ``load_*_seconds`` counters): waiting for the load
    thread (an async load), the host (lookup, reads, checks, queueing the copies), and on a GPU the
    engine's stream from the load's first copy to its last (CUDA events around them; other work
    queued on that stream meanwhile counts too). A layer-wise load's copies run over the forward:
    its device seconds are not timed (``layer_wait_seconds`` is its cost)."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self.began = self._started = time.perf_counter()
        self.stream, self.queued, self.host = stream, 0.0, 0.0
        self._first, self._last = self._event(timing=True), None  # the copies are queued after it

    def started(self) -> None:
        """The load thread took the load up: its copies are queued after this."""
        self._started = time.perf_counter()
        self.queued = self._started - self.began
        self._first = self._event(timing=True)

    def issued(self, whole: bool = True) -> None:
        """Every copy is queued (``whole``: else a layer-wise load's are still coming, not timed)."""
        self.host = time.perf_counter() - self._started
        if not whole:
            self._first = None
        self._last = self._event(timing=self._first is not None)

    def _event(self, timing: bool) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.stream)
        return event

    def ran(self) -> bool:
        """Whether the load's copies have run (at once on the CPU)."""
        return self._last is None or self._last.query()

    def device_seconds(self) -> float:
        """Seconds the stream took from the first copy to the last (0 on the CPU; call once ran)."""
        if self._first is None or self._last is None:
            return 0.0
        return self._first.elapsed_time(self._last) / 1e3


class KDNStats(KVConnectorStats):
    """The connector counters' increments over one interval (what vLLM logs and puts on /metrics)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():  # counters add, a histogram's observations join
            self.data[name] = self.data.get(name, [] if isinstance(value, list) else 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters (what vLLM logs each interval); a histogram's observations as their count."""
        return {name: len(value) if isinstance(value, list) else value for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KDNPromMetrics(KVConnectorPromMetrics):
    """kdn's counters as Prometheus counters ``vllm:kdn_<name>`` (per engine), on vLLM's /metrics."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name in NAMES:
            counter = self._counter_cls(name=f"vllm:kdn_{name}", labelnames=labelnames,
                                        documentation=f"kdn connector: {name.replace('_', ' ')}")
            self._counters[name] = {i: counter.labels(*values) for i, values in per_engine_labelvalues.items()}
        for name, metric in HISTOGRAMS.items():
            histogram = self._histogram_cls(name=metric, labelnames=labelnames, buckets=BUCKETS,
                                            documentation=f"kdn connector: seconds of each {name.split('_')[0]}")
            self._counters[f"{name}:samples"] = {i: histogram.labels(*values)
                                                 for i, values in per_engine_labelvalues.items()}
        reads = self._histogram_cls(name=TIER_READS, labelnames=[*labelnames, "tier"], buckets=BUCKETS,
                                    documentation="kdn connector: seconds of each batched read of one tier")
        for tier in TIERS:
            self._counters[f"tier_read_seconds:{tier}"] = {i: reads.labels(*values, tier)
                                                          for i, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name not in self._counters:
                continue
            if isinstance(value, list):
                for seconds in value:
                    self._counters[name][engine_idx].observe(seconds)
            elif value > 0:
                self._counters[name][engine_idx].inc(value)
