"""A subscriber to a vLLM engine's KV event stream (ZMQ, loopback), as a router's indexer is: every
batch decoded with vLLM's own types, for tests/vllm_engine.py --kv-events (run in the vLLM venv)."""

from __future__ import annotations

import threading

KDN_MEDIA = ("CPU", "STORAGE")  # kdn's memory, disk and remote tiers; vLLM's own blocks are "GPU"


class EventListener:
    """Subscribes on ``tcp://127.0.0.1:<port>`` (topic ``kv``) from a thread until :meth:`close`: it binds,
    and vLLM's publisher, given a host that is not a wildcard, connects to it."""

    def __init__(self, port: int):
        import zmq

        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.bind(self.endpoint)
        self.batches: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _, _, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.batches.append(decoder.decode(payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)

    def summary(self) -> dict:
        """kdn's announcements and vLLM's own, per block: ``{"kdn": [[medium, stored, hash, tokens,
        parent], ...], "vllm": {hash: [tokens, parent]}}`` (hashes hex, in the order published; a remote
        store's medium as ``STORAGE/REMOTE``)."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        kdn, own = [], {}
        for batch in self.batches:
            for e in batch.events:
                if not isinstance(e, (BlockStored, BlockRemoved)):
                    continue
                where = (e.medium or "") + ("/REMOTE" if getattr(e, "locality", None) == "REMOTE" else "")
                for j, h in enumerate(e.block_hashes):
                    if isinstance(e, BlockRemoved):
                        if e.medium in KDN_MEDIA:
                            kdn.append([where, False, _hex(h), None, None])
                        continue
                    tokens = list(e.token_ids[j * e.block_size:(j + 1) * e.block_size])
                    parent = _hex(e.block_hashes[j - 1] if j else e.parent_block_hash)
                    if e.medium in KDN_MEDIA:
                        kdn.append([where, True, _hex(h), tokens, parent])
                    else:
                        own[_hex(h)] = [tokens, parent]
        return {"kdn": kdn, "vllm": own}


def _hex(block_hash) -> str | None:
    if block_hash is None:
        return None
    return block_hash.hex() if isinstance(block_hash, bytes) else format(block_hash, "x")
