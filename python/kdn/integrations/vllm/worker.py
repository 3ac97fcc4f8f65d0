"""The vLLM connector's worker half: loads chunks into vLLM's paged blocks before the forward that
needs them (whole or layer by layer, or in the background before the request is scheduled: vLLM's
asynchronous KV load), reports what could not be loaded, and stores finished prompts:
copied out of the blocks before they are reused (sealed straight from CPU blocks; a GPU's span
to pinned host memory, sealed on the store thread), filed from a background thread
(:mod:`kdn.integrations.vllm`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kdn._core import InvalidInputError
from kdn.engine import Engine, ModelSession, passages
from kdn.engine.messages import MAX_ENDED
from kdn.engine.paged import PagedLayout, vllm_layout
from kdn.engine.served import Served, ServedRequests
from kdn.engine.stores import StoreJob, StoreQueue
from kdn.engine.stream import DeliveryError
from kdn.engine.targets import PagedBlocks
from kdn.integrations.vllm import layers, metrics
from kdn.integrations.vllm.kv_layers import KVGroups, layer_index
from kdn.integrations.vllm.specs import KDNConnectorMetadata, LoadSpec, SaveSpec

log = logging.getLogger("kdn")


class WorkerSide:
    """The worker's half of :class:`kdn.integrations.vllm.KDNConnector` over the KV blocks vLLM
    registered (``kv_caches``: one tensor per layer, read and written by the strides of the layout
    ``kernel(layer)`` names, :func:`kdn.engine.paged.vllm_layout`; ``groups``: vLLM's KV cache groups,
    a block table each; ``longest``: the longest prompt the engine takes, whose hit the host buffers
    are kept for on a GPU; ``stack``: the engine's own layers, :mod:`kdn.integrations.vllm.layers`,
    that blended loads recompute with, or None and ``blend_reason`` why not). Raises
    InvalidInputError when the blocks are not laid out as kdn can read (then the connector serves
    nothing)."""

    def __init__(self, engine: Engine, session: ModelSession, block_size: int, kv_caches: dict[str, torch.Tensor],
                 kernel: Callable[[torch.Tensor], str], groups: KVGroups | None = None, longest: int = 0,
                 stack=None, blend_reason: str | None = None):
        self.engine, self.session, self.block_size, self._kernel = engine, session, block_size, kernel
        self.stack, self.blend_reason = stack, blend_reason
        self.blend_vouched = False  # the stack's KV compared with a prefill the engine computed (layers.vouch)
        ordered = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        # each layer's KV cache group (whose block table it reads), or None: one table for all layers
        self._layer_groups = (groups or KVGroups()).table_of([name for name, _ in ordered])
        self._failed: set[str] = set()  # a windowed model's requests whose async load failed: recomputed whole
        self._warned_window = False
        self.layout: PagedLayout = self._describe([t for _, t in ordered])  # how kdn reads vLLM's blocks
        # kdn's C++ core copies chunks in and out of the blocks by the strides that describe them
        # (kdn.engine.paged, kdn/paged.h); on a GPU with the CUDA twin, on vLLM's current stream
        self._blocks = [t for _, t in ordered]
        # on a GPU: hits upload straight from the tiers' blobs, and a hit of the engine's longest prompt
        # (``longest`` tokens, vLLM's max_model_len) is read into host blocks locked once
        engine.serving_on(self._blocks[0].device, longest * session.layout.bytes_per_token())
        self._errors: set[int] = set()
        self._served = ServedRequests()  # what kdn served each running request, where its saves ended
        self._streams: list = []  # (load spec, LayerStream) of this step's layer-wise loads
        # what the store thread files; it keeps which requests' stores have ended (landed, refused or
        # failed) until the scheduler asks (ended_stores, in this process or through the lookup
        # server): a store that cannot land holds no one; the oldest are forgotten when nobody asks
        self.stores = StoreQueue(engine, metrics.count, keep_ended=MAX_ENDED)
        # async loads (LoadSpec.before): one background thread, in order
        self._before = ThreadPoolExecutor(1, thread_name_prefix="kdn-load")
        self._loaded: list = []  # (spec, load or None, metrics.LoadClock, blocks) of async loads read and queued
        self._loaded_lock = threading.Lock()
        self._timing: list[metrics.LoadClock] = []  # in-step loads whose copies may still run

    def _describe(self, layers: list[torch.Tensor]) -> PagedLayout:
        """One layout for every layer's tensor, checked against the model and vLLM's block size."""
        model = self.session.layout
        if len(layers) != model.layers:
            raise InvalidInputError(f"{len(layers)} KV tensors for a model of {model.layers} layers")
        first = layers[0]
        layout = vllm_layout(first, self._kernel(first))
        found = (layout.kv_heads, layout.head_dim, layout.block_size)
        if found != (model.kv_heads, model.head_dim, self.block_size):
            raise InvalidInputError(f"{tuple(first.shape)} holds {found[0]} heads x {found[1]} dims in blocks of "
                                    f"{found[2]}; the model has {model.kv_heads} x {model.head_dim}, vLLM's blocks "
                                    f"are {self.block_size} tokens")
        odd = [i for i, t in enumerate(layers) if (t.shape, t.stride(), t.dtype, t.device)
               != (first.shape, first.stride(), first.dtype, first.device)]
        if odd:
            raise InvalidInputError(f"layer {odd[0]}'s tensor {tuple(layers[odd[0]].shape)} is not laid out "
                                    f"like layer 0's {tuple(first.shape)}")
        return layout

    def start_load_kv(self, meta: KDNConnectorMetadata) -> None:
        for req_id in meta.fresh:
            self._served.start(req_id)
        for spec in meta.loads:
            if spec.before:
                self._load_before(spec)
                continue
            served = self._served.of(spec.req_id)
            tokens = np.asarray(spec.tokens, dtype=np.uint32)
            blocks = self._paged(spec.block_ids, spec.start)
            clock = metrics.LoadClock(blocks.stream)
            if spec.blend is not None:  # joined from its passages and recomputed here, before the forward
                self._account(spec, served, self._blend(spec, served, tokens, blocks), clock, blocks, stale_step=True)
                continue
            # layer-wise when the engine streams: layers arrive while the model computes the ones before
            load = self.engine.load(self.session.within(spec.scope), tokens, spec.end, blocks,
                                    lambda _, blocks=blocks: blocks, clock.began, spec.found)
            clock.issued(whole=load.stream is None)
            served.lossy |= load.lossy  # a stream's is known when it ends (_finish_streams)
            if load.stream is not None:
                self._streams.append((spec, load))
            self._account(spec, served, load.hit, clock, blocks, stale_step=True)

    def _blend(self, spec: LoadSpec, served: Served, tokens: np.ndarray, blocks: PagedBlocks) -> int:
        """Lay the blended span of ``spec`` into its blocks (:func:`kdn.engine.passages.blended`); the
        tokens laid (short of ``spec.end`` where a passage is gone since the lookup: vLLM recomputes
        from there). Blended KV is its own fidelity class: nothing computed over it is stored."""
        began = time.perf_counter()
        try:
            end, kv, recomputed = passages.blended(self.engine, self.session.within(spec.scope), self.stack,
                                                   spec.blend, tokens, self.stack.device)
            if kv is not None:
                blocks.lay(kv, spec.start, end)
        except Exception as exc:  # noqa: BLE001 - a failed blend is a failed load: vLLM computes the span
            log.warning("kdn: a blended load failed (%s); vLLM computes its tokens", exc)
            end, recomputed = 0, 0
        if end > spec.start:
            served.lossy = True
            metrics.count(blends=1, blended_tokens=end - spec.start, recomputed_layer_tokens=recomputed)
        metrics.count(blend_seconds=time.perf_counter() - began)
        return end

    def _paged(self, block_ids: list, start: int = 0) -> PagedBlocks:
        """A request's blocks (``block_ids``: a table per KV cache group) as kdn's copies take them."""
        if self._layer_groups is None:
            return PagedBlocks(self._blocks, self.layout, block_ids[0], start)
        return PagedBlocks(self._blocks, self.layout, block_ids, start, self._layer_groups)

    def _account(self, spec: LoadSpec, served: Served | None, hit: int, clock: metrics.LoadClock,
                 blocks: PagedBlocks, stale_step: bool) -> None:
        """A load of ``spec`` that served ``hit`` tokens: what the request was served, counted; tokens
        short of the lookup's are reported (evicted or unusable since: vLLM recomputes their blocks)."""
        upto = min(hit, spec.end)
        if served is not None:
            served.tokens = max(served.tokens, upto)
            if upto < spec.end:
                self._load_failed(spec, max(upto, spec.start), "evicted or damaged since the lookup", stale_step)
        metrics.count(loads=1, loaded_tokens=max(0, upto - spec.start), hit_tokens=max(0, upto - spec.start),
                      loaded_layer_tokens=blocks.layer_tokens(upto),
                      load_seconds=time.perf_counter() - clock.began, load_queue_seconds=clock.queued,
                      load_host_seconds=clock.host)
        if clock.ran():
            metrics.count(load_device_seconds=clock.device_seconds())
        else:  # an in-step load's copies run behind this call: timed once they have (_count_devices)
            self._timing.append(clock)

    def _count_devices(self) -> None:
        """Count the device seconds of the in-step loads whose copies have run."""
        waiting = []
        for clock in self._timing:
            if clock.ran():
                metrics.count(load_device_seconds=clock.device_seconds())
            else:
                waiting.append(clock)
        self._timing = waiting

    def _load_before(self, spec: LoadSpec) -> None:
        """Start an async load: read and laid into the blocks by the load thread, on the GPU on this
        (the engine's) stream; reported by :meth:`get_finished` once its copies have run."""
        self._served.start(spec.req_id)  # the request starts here: its step will not restart it
        blocks = self._paged(spec.block_ids, spec.start)
        clock = metrics.LoadClock(blocks.stream)

        def load() -> None:
            clock.started()
            try:
                done = self.engine.load(self.session.within(spec.scope), np.asarray(spec.tokens, dtype=np.uint32),
                                        spec.end, blocks, None, clock.began, spec.found)
            except Exception as exc:  # reported as a failed load: vLLM recomputes the request's blocks
                log.warning("kdn: an async load failed (%s)", exc)
                done = None
            clock.issued()
            with self._loaded_lock:
                self._loaded.append((spec, done, clock, blocks))

        self._before.submit(load)

    def _report_loaded(self) -> set[str]:
        """The async loads whose copies have run: counted, their failures reported; their request ids."""
        self._count_devices()
        ready, waiting = [], []
        with self._loaded_lock:
            for item in self._loaded:
                (ready if item[2].ran() else waiting).append(item)
            self._loaded = waiting
        for spec, done, clock, blocks in ready:
            served = self._served.get(spec.req_id)  # None: the request ended (aborted) while it loaded
            if served is not None:
                served.lossy |= done is not None and done.lossy
            # no step ran on these blocks: a failure's recomputed prefill is stored
            self._account(spec, served, done.hit if done is not None else 0, clock, blocks, stale_step=False)
        return {spec.req_id for spec, *_ in ready}

    def _load_failed(self, spec: LoadSpec, start: int, why: str, stale_step: bool = True) -> None:
        """Tokens [start, spec.end) of a request were not loaded: vLLM recomputes their blocks
        (``stale_step``: this step's forward ran on them, so nothing of it is stored this step)."""
        if self._layer_groups is None:
            first = start // self.block_size
            self._errors.update(spec.block_ids[0][first: -(-spec.end // self.block_size)])
        else:  # a block of one group cannot be named to vLLM, nor recomputed from its middle: the whole request
            self._failed.add(spec.req_id)
        if stale_step:
            self._served.of(spec.req_id).failed = True
        log.warning("kdn: %d of %d tokens could not be loaded (%s); vLLM recomputes them", spec.end - start,
                    spec.end - spec.start, why)
        metrics.count(load_errors=1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._streams:
            return  # loaded whole by start_load_kv
        layer, began = layer_index(layer_name), time.perf_counter()
        for spec, load in self._streams:
            try:
                load.stream.wait(layer)
            except DeliveryError as e:  # reported after the forward; vLLM recomputes the request's blocks
                log.debug("kdn: layer %d of request %s not delivered: %s", layer, spec.req_id, e)
        metrics.count(layer_wait_seconds=time.perf_counter() - began)  # the model waiting for kdn's layers

    def _finish_streams(self) -> None:
        """After the forward: every stream of this step has ended; a failed one's blocks are reported."""
        streams, self._streams = self._streams, []
        for spec, load in streams:
            ended = load.finish()
            if ended.failed:
                self._load_failed(spec, spec.start, "delivery failed before its last layer")
            if ended.lossy:  # known once its last group arrived
                self._served.of(spec.req_id).lossy = True

    def wait_for_save(self, meta: KDNConnectorMetadata) -> None:
        self._finish_streams()  # every load of this step has ended: the rule below sees its failures
        for spec in meta.saves:
            n = len(spec.tokens)
            session = self.session.within(spec.scope)
            served = self._served.get(spec.req_id) or Served()
            if self.stack is not None and spec.blend is not None:
                self._blending_save(spec, session, served)
            if spec.check is not None:
                served.checked = spec.check[1] - spec.check[0]
            store = served.unstorable() is None and not served.covers(n, self.session.probe_step)
            check = spec.check if not served.failed else None  # a failed step's blocks are stale: no check
            if not store and check is None:  # refused, or kdn served it all: held already, kept as asked
                self.stores.skip(spec.req_id, session, np.asarray(spec.tokens, dtype=np.uint32), served, spec.retain,
                                 final=not spec.partial)
                continue
            # copies: the blocks are vLLM's to reuse once this returns. The chunks to store (those no
            # local tier holds) are sealed straight from CPU blocks; a GPU's are copied to pinned host
            # memory in one device-to-host copy, and sealed by the store thread, which files them
            began = time.perf_counter()
            tokens = np.asarray(spec.tokens, dtype=np.uint32)
            blocks = self._paged(spec.block_ids)
            packed = unheld = None
            if store and (blocks.grouped or blocks.device.type == "cuda"):
                keys, todo = self.engine.unheld(session, tokens)
                todo = self._windowed(spec, blocks, todo) if blocks.grouped else todo
                store, unheld = todo is not None, (keys, todo)
            if store and blocks.device.type == "cuda":  # copied out in the step, sealed on the store thread
                packed = functools.partial(self.engine.pack, session, tokens, blocks.copy_out(unheld[1]), unheld)
            elif store:
                packed = self.engine.pack(session, tokens, blocks, unheld)
            first, kv = blocks.emit(*check) if check is not None else (0, None)
            metrics.count(gather_seconds=time.perf_counter() - began)
            self.stores.put(StoreJob(spec.req_id, session, tokens, dataclasses.replace(served), packed, check, first,
                                     kv, spec.retain, final=not spec.partial))
        self._served.step_ended()  # vLLM recomputes what failed: the recomputed prefill is stored

    def _blending_save(self, spec: SaveSpec, session: ModelSession, served: Served) -> None:
        """A finished prefill of a request that named passages: the first whose blocks hold exact KV
        (computed by the engine, or an exact hit) vouches for the engine's layers as kdn runs them
        (blending waits for it: an engine whose requests never blend runs none of it); then its
        passages no tier holds are computed alone and stored."""
        try:
            if not self.blend_vouched and not served.lossy and not served.failed:
                first = self._paged(spec.block_ids).emit(0, min(len(spec.tokens), layers.VOUCH_TOKENS))[1]
                self._vouched(layers.vouch(self.stack, spec.tokens, first))
            if self.blend_vouched:
                stored = passages.store_missing(self.engine, session, self.stack, spec.blend,
                                                np.asarray(spec.tokens, dtype=np.uint32), self.stack.device)
                metrics.count(stored_passages=stored)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's step: blending goes off, serving goes on
            self._vouched(f"running the engine's layers failed ({type(exc).__name__}: {exc})")

    def _vouched(self, why: str | None) -> None:
        if why is None:
            self.blend_vouched = True
            log.info("kdn: blending vouched for: the engine's layers, run by kdn, give the KV of its own forward")
        else:
            self.stack, self.blend_reason = None, why
            log.warning("kdn: blending is off in this engine: %s", why)

    def _windowed(self, spec: SaveSpec, blocks: PagedBlocks, todo: list) -> list | None:
        """The chunks of ``todo`` a windowed model's save packs: those its request's earlier saves did
        not, when every layer's blocks still hold them; None: nothing more of the prompt can be stored.
        vLLM gives a sliding layer's blocks back once the prefill is a window past them: a chunk whose
        blocks went before it was stored (a step ended inside it more than a window past its start)
        ends what can be stored of the prompt."""
        done = self._served.saved_to(spec.req_id, final=not spec.partial)
        todo = [c for c in todo if c[0] >= done] if done != ServedRequests.LOST else None
        if todo and todo[0][0] < max(spec.kept_from, blocks.kept_from()):
            if not self._warned_window:
                self._warned_window = True
                log.warning("kdn: a prefill step ended more than a sliding window into a chunk of %d tokens: the "
                            "prompt is stored up to position %d (give vLLM's steps room for whole chunks: "
                            "max_num_batched_tokens)", self.session.chunk_size, todo[0][0])
            todo = None
        if spec.partial:
            self._served.saved(spec.req_id, ServedRequests.LOST if todo is None else todo[-1][0] + todo[-1][1] if todo
                               else done)
        return todo

    def ended_stores(self) -> list[str]:
        """The requests whose store has ended (landed, refused or failed) since the last call."""
        return self.stores.ended()

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """The requests whose async loads ended since the last call (their failures are reported by
        the next :meth:`get_block_ids_with_load_errors`, which vLLM asks in the same step)."""
        self._served.ended(finished_req_ids)
        return self._report_loaded()

    def failed_requests(self) -> set[str]:
        """The requests whose async load failed since the last call (a windowed model's: vLLM
        recomputes them whole)."""
        failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish queued stores (they are on disk / sent when this returns)."""
        self._before.shutdown(wait=True)
        self.stores.shutdown()

    def drain(self) -> None:
        """Wait until every store queued so far is filed (:meth:`kdn.engine.stores.StoreQueue.drain`)."""
        self.stores.drain()

