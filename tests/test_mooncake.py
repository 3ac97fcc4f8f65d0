"""The remote tier over a real Mooncake Store (mooncake_master + a mooncake_client holding the memory
pool, on 127.0.0.1): exact KV across processes, values split into parts, planted values, a master
that stops answering (no call stalls; hits resume), and the transport's options and refusals."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import full_prefill, random_ids
from disk_helpers import python_process
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.layout import cache_to_kv_list
from redis_servers import free_port, wait_until

CHUNK = 8


def binary(name: str) -> str:
    """A Mooncake server binary: the one its pip package ships, else one on PATH."""
    import mooncake

    shipped = Path(mooncake.__file__).parent / name
    return str(shipped) if shipped.is_file() else (shutil.which(name) or name)


def require_mooncake() -> None:
    """Skip without Mooncake's client and servers, unless KDN_REQUIRE_SERVERS=1 (.ci/run): then fail."""
    try:
        import mooncake.store  # noqa: F401
        if all(Path(binary(n)).is_file() for n in ("mooncake_master", "mooncake_client")):
            return
        why = "the mooncake_master / mooncake_client binaries are missing"
    except ImportError as e:
        why = f"Mooncake's client does not import ({e}): pip install mooncake-transfer-engine-non-cuda, " \
              "apt-get install libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4"
    if os.environ.get("KDN_REQUIRE_SERVERS") == "1":
        pytest.fail(why)
    pytest.skip(why)


class Mooncake:
    """A master (HTTP metadata server inside) and one client process lending 256 MB to the pool."""

    def __init__(self, log_dir):
        self.rpc, self.http, metrics, client = free_port(), free_port(), free_port(), free_port()
        self.url = f"mooncake://127.0.0.1:{self.rpc}"
        self.opened: list[KDN] = []
        self.options = {"metadata_server": f"http://127.0.0.1:{self.http}/metadata"}
        self._logs = [open(log_dir / "master.log", "w"), open(log_dir / "client.log", "w")]
        self.master = subprocess.Popen([binary("mooncake_master"), f"--rpc_port={self.rpc}",
                                        f"--metrics_port={metrics}", "--enable_http_metadata_server=true",
                                        f"--http_metadata_server_port={self.http}"],
                                       stdout=self._logs[0], stderr=subprocess.STDOUT)
        wait_until(lambda: _listening(self.rpc) and _listening(self.http), 30, "mooncake_master did not start")
        self.pool = subprocess.Popen([binary("mooncake_client"), f"--master_server_address=127.0.0.1:{self.rpc}",
                                      f"--metadata_server={self.options['metadata_server']}", "--host=127.0.0.1",
                                      f"--port={client}", "--global_segment_size=256MB"],
                                     stdout=self._logs[1], stderr=subprocess.STDOUT)
        wait_until(lambda: _listening(client), 30, "mooncake_client did not start")

    def config(self, **settings) -> KDNConfig:
        return KDNConfig(**{"chunk_size": CHUNK, "remote_url": self.url, "remote_options": self.options, **settings})

    def open(self, **settings) -> KDN:
        """A KDN over this store, closed before the store stops (a client outliving its master
        reports each failed unregistration at exit)."""
        self.opened.append(KDN(self.config(**settings)))
        return self.opened[-1]

    def stop(self) -> None:
        for kdn in self.opened:
            kdn.close()
        for proc in (self.pool, self.master):
            proc.kill()
            proc.wait(timeout=30)
        for log in self._logs:
            log.close()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    require_mooncake()
    store = Mooncake(tmp_path_factory.mktemp("mooncake"))
    yield store
    store.stop()


STORER = """
import json, sys
import torch
from kdn import KDN, KDNConfig
from kdn.models.tiny import tiny_model
model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
kdn = KDN(KDNConfig(chunk_size=8, remote_url=sys.argv[1], remote_options=json.loads(sys.argv[2])))
ids = torch.tensor([[int(t) for t in sys.argv[3].split(",")]])
kdn.generate(model, ids, max_new_tokens=1, do_sample=False)
kdn.flush()
print(kdn.stats()["remote"]["puts"])
"""


def test_process_b_reads_exactly_what_process_a_stored(tiny_llama, mooncake):
    import json

    ids = random_ids(tiny_llama, 201, seed=21)
    proc = python_process(STORER, mooncake.url, json.dumps(mooncake.options), ",".join(map(str, ids[0].tolist())),
                          stdout=subprocess.PIPE, text=True)
    assert int(proc.communicate(timeout=120)[0].strip().splitlines()[-1]) == 25 and proc.returncode == 0
    reader = mooncake.open()  # a new process' view: its memory is empty, the writer has exited
    assert reader.lookup(tiny_llama, ids) == 200
    cache, hit = reader.retrieve(tiny_llama, ids, limit=200)
    logits_ref, reference = full_prefill(tiny_llama, ids)
    for got, want in zip(cache_to_kv_list(cache), cache_to_kv_list(reference)):
        torch.testing.assert_close(got, want[:, :, :200], rtol=0, atol=1e-6)  # another process' own prefill
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=cache).logits[0, -1]
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)
    assert reader.stats()["remote"]["hits"] == 25


def test_values_split_into_parts_and_removed(tiny_llama, mooncake):
    kdn = mooncake.open(remote_part_bytes=1024)  # a chunk is ~4.2 KB: a manifest and 5 parts
    ids = random_ids(tiny_llama, 33, seed=22)
    _, reference = full_prefill(tiny_llama, ids)
    kdn.store(tiny_llama, ids, reference)
    kdn.flush()
    reader = mooncake.open(remote_part_bytes=1024)
    cache, hit = reader.retrieve(tiny_llama, ids, limit=32)
    assert hit == 32
    for got, want in zip(cache_to_kv_list(cache), cache_to_kv_list(reference)):
        assert torch.equal(got, want[:, :, :32])
    assert reader.evict(tiny_llama, ids) >= 4  # from every tier, the store's parts included
    assert mooncake.open().lookup(tiny_llama, ids) == 0


def test_closing_sends_what_is_queued(tiny_llama, mooncake):
    ids = random_ids(tiny_llama, 33, seed=25)
    _, reference = full_prefill(tiny_llama, ids)
    with KDN(mooncake.config()) as kdn:
        kdn.store(tiny_llama, ids, reference)  # queued for the store; closing sends it, then disconnects
    cache, hit = mooncake.open().retrieve(tiny_llama, ids, limit=32)
    assert hit == 32
    for got, want in zip(cache_to_kv_list(cache), cache_to_kv_list(reference)):
        assert torch.equal(got, want[:, :, :32])


def test_planted_values_are_misses_of_their_chunk_alone(tiny_llama, mooncake):
    kdn = mooncake.open()
    ids = random_ids(tiny_llama, 24, seed=23)
    _, reference = full_prefill(tiny_llama, ids)
    kdn.store(tiny_llama, ids, reference)
    kdn.flush()
    keys = kdn.chunk_keys(tiny_llama, ids)
    tier = kdn.remote
    tier.transport.put([(tier.redis_key(keys[1]), b"\x00" * 20)], None)  # 20 bytes where a chunk was
    reader = mooncake.open()
    assert reader.retrieve(tiny_llama, ids, limit=24)[1] == 8  # the first chunk, then a miss
    assert reader.stats()["remote"]["corrupt"] == 1
    big = mooncake.open(remote_part_bytes=16384)  # a chunk is ~4.2 KB
    tier.transport.put([(tier.redis_key(keys[0]), b"\x01" * 32768)], None)  # larger than the tier writes
    assert big.retrieve(tiny_llama, ids, limit=24)[1] == 0
    assert big.stats()["remote"]["corrupt"] == 2  # both planted values, read in one round trip; the third is fine


def test_a_stopped_master_never_stalls_a_request_and_hits_resume(tiny_llama, mooncake):
    kdn = mooncake.open(remote_timeout=0.5, remote_retry_seconds=0.3)
    ids = random_ids(tiny_llama, 41, seed=24)
    expected = tiny_llama.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(kdn.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False), expected)
    kdn.flush()
    connected = mooncake.open(remote_timeout=0.5, remote_retry_seconds=0.3)
    assert connected.lookup(tiny_llama, ids) == 40  # connected before the master falls silent
    mooncake.master.send_signal(signal.SIGSTOP)  # up, silent: Mooncake's own calls would wait 30 s
    try:
        for reader in (connected, mooncake.open(remote_timeout=0.5, remote_retry_seconds=0.3)):
            started = time.monotonic()
            assert torch.equal(reader.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False), expected)
            assert time.monotonic() - started < 5 and reader.last_generate["hit_tokens"] == 0
            assert reader.stats()["remote"]["state"] == "down"
    finally:
        mooncake.master.send_signal(signal.SIGCONT)
    wait_until(lambda: reader.lookup(tiny_llama, ids) == 40, 30, "hits did not resume after the master answered")
    assert torch.equal(reader.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False), expected)
    assert reader.last_generate["hit_tokens"] == 40


def test_options_are_checked_and_what_mooncake_cannot_do_is_refused(mooncake):
    with pytest.raises(InvalidInputError, match="metadata_server"):  # the message lists the options
        KDN(KDNConfig(remote_url=mooncake.url, remote_options={"metadata": "http://x"}))
    with pytest.raises(InvalidInputError, match="global_segment_bytes"):
        KDN(KDNConfig(remote_url=mooncake.url, remote_options={"global_segment_bytes": "lots"}))
    with pytest.raises(InvalidInputError, match="remote_ttl"):  # Mooncake keeps no expiry
        mooncake.open(remote_ttl=60)
    kdn = mooncake.open(remote_options={**mooncake.options, "local_buffer_bytes": "32MiB"})
    assert kdn.remote.transport.options.local_buffer_bytes == 32 << 20
    with pytest.raises(InvalidInputError, match="cannot list"):
        list(kdn.remote.keys())
    assert kdn.remote.claims.claim(b"k" * 16, "engine-a", ttl=5) is None  # no expiry: no claims, compute now
