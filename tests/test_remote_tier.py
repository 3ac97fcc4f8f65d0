"""The remote tier on real Redis servers: sharing across processes, cluster, faults, bad values, auth."""

import logging
import subprocess
import time

import pytest
import torch

from conftest import full_prefill, random_ids
from disk_helpers import blob_for, key, python_process
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.storage.remote import RemoteTier
from redis_servers import RedisServer, require_redis

CHUNK = 8


def fresh_tier(url, **kw) -> RemoteTier:
    tier = RemoteTier(url, **kw)
    tier.clear()
    return tier


def count_round_trips(tier, monkeypatch) -> list:
    """Records every round trip the tier makes: each transport call is one (pipelined), and so
    is each pipeline the Redis client executes underneath."""
    calls = []
    make_pipeline = tier.transport.client.pipeline

    def pipeline(*args, **kwargs):
        pipe = make_pipeline(*args, **kwargs)
        execute = pipe.execute
        pipe.execute = lambda *a, **k: (calls.append("pipeline"), execute(*a, **k))[1]
        return pipe

    monkeypatch.setattr(tier.transport.client, "pipeline", pipeline)
    if tier.transport.direct:  # reads and lookups on kdn's RESP client, outside redis-py: one round trip each
        for method in ("get", "exists"):
            call = getattr(tier.transport, method)
            monkeypatch.setattr(tier.transport, method,
                                lambda names, call=call: (calls.append("pipeline"), call(names))[1])
    return calls


def test_put_and_pipelined_lookup_in_one_round_trip(redis_server, monkeypatch):
    tier = fresh_tier(redis_server.url)
    for i in range(128):
        assert tier.put(key(i), blob_for(i))
    tier.flush()
    keys = [key(i) for i in range(128)] + [key(999)]
    calls = count_round_trips(tier, monkeypatch)
    assert tier.count_prefix(keys) == 128
    blobs = tier.get_many(keys)
    assert calls == ["pipeline", "pipeline"]  # one for the 129 lookups, one for the 129 reads
    assert [bytes(b) for b in blobs[:128]] == [bytes(blob_for(i)) for i in range(128)] and blobs[128] is None
    stats = tier.stats()
    assert stats["puts"] == 128 and stats["hits"] == 128 and stats["misses"] == 1 and stats["state"] == "ok"


def test_large_values_are_split_and_reassembled(redis_server, monkeypatch):
    tier = fresh_tier(redis_server.url, part_bytes=1000)
    blob = blob_for(5, tokens=64)  # ~16 KB -> 17 parts
    assert tier.put(key(5), blob, wait=True)
    name = tier.redis_key(key(5))
    assert redis_server.cli("EXISTS", f"{name}:p17").stdout.strip() == "1"
    calls = count_round_trips(tier, monkeypatch)
    assert bytes(tier.get_many([key(5)])[0]) == bytes(blob)
    assert calls == ["pipeline", "pipeline"]
    redis_server.cli("DEL", f"{name}:p3")  # a part expired or evicted: a miss, not a wrong blob
    assert tier.get_many([key(5)]) == [None]


def test_garbage_or_foreign_values_are_misses(redis_server, caplog):
    tier = fresh_tier(redis_server.url)
    for i in range(3):
        tier.put(key(i), blob_for(i), wait=True)
    redis_server.cli("SET", tier.redis_key(key(0)), "garbage")
    tier.transport.put([(tier.redis_key(key(1)), bytes(blob_for(7)))], None)  # a valid blob under another chunk's name
    with caplog.at_level(logging.WARNING, logger="kdn"):
        assert tier.get_many([key(0)]) == [None]
        assert tier.get_many([key(1)]) == [None]
    assert tier.stats()["corrupt"] == 2 and bytes(tier.get_many([key(2)])[0]) == bytes(blob_for(2))
    assert len([r for r in caplog.records if "unusable value" in r.getMessage()]) == 1


def test_ttl_is_set(redis_server):
    tier = fresh_tier(redis_server.url, ttl=100)
    tier.put(key(1), blob_for(1), wait=True)
    assert 0 < int(redis_server.cli("TTL", tier.redis_key(key(1))).stdout) <= 100


def test_values_are_sent_in_the_tier_codec_and_promoted_raw(tiny_llama, redis_server):
    from kdn import codecs

    ids = random_ids(tiny_llama, 33, seed=9)
    reference, cache = full_prefill(tiny_llama, ids)
    config = KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url, remote_codec="int8")
    first = KDN(config)
    first.remote.clear()
    first.store(tiny_llama, ids, cache)
    first.flush()
    keys = first.chunk_keys(tiny_llama, ids[0].tolist())
    lossy_key = codecs.address(keys[0], "int8")  # lossy KV is filed under its own key
    assert first.remote.transport.get([first.remote.redis_key(keys[0])]) == [None]
    stored = first.remote.transport.get([first.remote.redis_key(lossy_key)])[0]
    assert codecs.codec_of(stored).spec == "int8" and len(stored) < 0.4 * len(first.memory.get(keys[0]))
    second = KDN(config)  # empty memory: served from the remote store, decoded, promoted raw
    got, hit = second.retrieve(tiny_llama, ids, limit=32)
    second.last_retrieve["stream"].wait_all()  # streamed layer-wise, then kept whole in memory
    assert hit == 32 and codecs.codec_of(second.memory.get(lossy_key)).name == "raw"
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=got).logits[0, -1]
    torch.testing.assert_close(logits.softmax(-1), reference.softmax(-1), atol=2e-3, rtol=0)


STORER = """
import sys
import torch
from kdn import KDN, KDNConfig
from kdn.models.tiny import tiny_model
model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
kdn = KDN(KDNConfig(chunk_size=8, remote_url=sys.argv[1]))
ids = torch.tensor([[int(t) for t in sys.argv[2].split(",")]])
kdn.generate(model, ids, max_new_tokens=1, do_sample=False)
kdn.flush()
print(kdn.stats()["remote"]["puts"])
"""


def another_process_stores(url, ids) -> int:
    proc = python_process(STORER, url, ",".join(map(str, ids[0].tolist())), stdout=subprocess.PIPE, text=True)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0
    return int(out.strip())


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_process_b_hits_what_process_a_stored(tiny_llama, redis_server, redis_cluster, where):
    url = redis_server.url if where == "single" else redis_cluster.url
    fresh_tier(url)
    ids = random_ids(tiny_llama, 201, seed=11)  # 25 chunks: enough keys to land on every master
    assert another_process_stores(url, ids) == 25
    kdn = KDN(KDNConfig(chunk_size=CHUNK, remote_url=url))
    assert kdn.lookup(tiny_llama, ids) == 200
    cache, hit = kdn.retrieve(tiny_llama, ids, limit=200)
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=cache).logits[0, -1]
    assert hit == 200
    torch.testing.assert_close(logits, full_prefill(tiny_llama, ids)[0], rtol=1e-4, atol=1e-4)
    kdn.last_retrieve["stream"].wait_all()  # streamed layer-wise: counted and promoted when the stream ends
    assert kdn.stats()["remote"]["hits"] == 25 and kdn.stats()["memory"]["entries"] == 25  # promoted
    if where == "cluster":
        sizes = [int(n.cli("DBSIZE").stdout) for n in redis_cluster.nodes]
        assert all(s > 0 for s in sizes), f"keys not spread over all masters: {sizes}"


def test_a_dead_server_never_reaches_the_caller_and_hits_resume(tiny_llama, tmp_path, caplog):
    require_redis()
    server = RedisServer(tmp_path / "redis")
    try:
        kdn = KDN(KDNConfig(chunk_size=CHUNK, remote_url=server.url, remote_timeout=0.5, remote_retry_seconds=0.3))
        ids = random_ids(tiny_llama, 33, seed=1)
        expected = tiny_llama.generate(ids, max_new_tokens=3, do_sample=False)
        server.stop()
        with caplog.at_level(logging.WARNING, logger="kdn"):
            for _ in range(3):
                assert torch.equal(kdn.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False), expected)
                kdn.flush()
                kdn.memory.clear()  # force lookups to the (dead) remote store
                assert kdn.lookup(tiny_llama, ids) == 0
        stats = kdn.stats()["remote"]
        assert stats["state"] == "down" and stats["errors"] >= 1 and stats["dropped"] + stats["skipped"] >= 1
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
        server.start()  # back on the same port, empty
        time.sleep(0.4)
        kdn.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False)  # its lookup finds the store back
        kdn.flush()
        kdn.memory.clear()
        assert kdn.lookup(tiny_llama, ids) == 32 and kdn.stats()["remote"]["state"] == "ok"
    finally:
        server.stop()


def test_a_wrong_password_is_a_clear_error_at_start_up(tmp_path):
    require_redis()
    server = RedisServer(tmp_path / "redis", None, "--requirepass", "s3cret")
    try:
        with pytest.raises(InvalidInputError, match=r"redis://:\*\*\*@127.*authentication failed") as info:
            KDN(KDNConfig(remote_url=f"redis://:wrong@127.0.0.1:{server.port}/0"))
        assert "wrong" not in str(info.value)
        ok = KDN(KDNConfig(remote_url=f"redis://:s3cret@127.0.0.1:{server.port}/0"))
        assert ok.stats()["remote"]["state"] == "ok"
    finally:
        server.stop()


def test_reads_land_in_buffers_with_a_password_and_error_replies_are_refusals(tmp_path, caplog):
    """Plain redis:// reads go through kdn's own RESP reader (replies straight into Buffers): with
    AUTH, the values are the ones written; an error reply (a key of another type) is a refused
    read, a miss, and the connection keeps serving."""
    require_redis()
    server = RedisServer(tmp_path / "redis", None, "--requirepass", "s3cret")
    try:
        tier = fresh_tier(f"redis://:s3cret@127.0.0.1:{server.port}/0")
        assert tier.transport.direct
        for i in range(3):
            tier.put(key(i), blob_for(i))
        tier.flush()
        got = tier.get_many([key(i) for i in range(3)] + [key(99)])
        assert [bytes(b) for b in got[:3]] == [bytes(blob_for(i)) for i in range(3)] and got[3] is None
        tier.transport.client.lpush(RemoteTier.redis_key(key(50)), b"a list, not a string")
        with caplog.at_level(logging.WARNING, logger="kdn"):
            assert tier.get_many([key(50), key(1)]) == [None, None]  # the whole read refused
        assert tier.stats()["refused"] == 1 and tier.stats()["state"] == "ok"
        assert bytes(tier.get_many([key(1)])[0]) == bytes(blob_for(1))
    finally:
        server.stop()


def test_an_unreachable_server_at_start_up_is_only_a_warning(caplog):
    require_redis()
    from redis_servers import free_port

    with caplog.at_level(logging.WARNING, logger="kdn"):
        kdn = KDN(KDNConfig(remote_url=f"redis://127.0.0.1:{free_port()}/0", remote_timeout=0.2))
    assert kdn.stats()["remote"]["state"] == "down"
    assert any("unreachable" in r.getMessage() for r in caplog.records)


def test_byte_ranges_through_kdns_reader_equal_redis_pys(redis_server):
    """GETRANGE replies received straight into Buffers (the layer-wise stream's reads) are the bytes
    redis-py reads: from the start, from the end, past the end, and empty for a missing value."""
    from kdn.storage.redis_transport import RedisTransport

    plain = RedisTransport(redis_server.url, 1.0, RedisTransport.Options(direct=False))
    direct = RedisTransport(redis_server.url, 1.0)
    assert direct.direct and not plain.direct
    value = bytes(range(256)) * 40
    direct.put([("kdn:test:ranges", value)], None)
    requests = [("kdn:test:ranges", 0, 79), ("kdn:test:ranges", -24, -1), ("kdn:test:ranges", 5000, 20000),
                ("kdn:test:absent", 0, 10)]
    got = [bytes(v) for v in direct.get_ranges(requests)]
    assert got == [bytes(v) for v in plain.get_ranges(requests)] == [value[:80], value[-24:], value[5000:], b""]
    assert direct.delete(["kdn:test:ranges", "kdn:test:absent"]) == 1


def test_writes_leave_from_the_values_memory_and_read_back_as_written(redis_server):
    """Plain redis:// writes go through kdn's RESP client, each value sent from its own memory: a kdn
    Buffer, bytes, an empty value, a memoryview of a value larger than the socket takes at once, and
    over 500 values in one pipeline (more pieces than one sendmsg takes). redis-py reads back the
    bytes written, with the TTL asked (none: none); a value that is not contiguous is refused."""
    from kdn.storage.redis_transport import RedisTransport

    plain = RedisTransport(redis_server.url, 1.0, RedisTransport.Options(direct=False))
    direct = RedisTransport(redis_server.url, 1.0)
    big = bytes(range(256)) * (24 << 12)  # 24 MiB
    values = [blob_for(1), b"", memoryview(big)[7:], *[bytes([i % 256]) * (i + 1) for i in range(500)]]
    names = [f"kdn:test:w{i}" for i in range(len(values))]
    direct.put(list(zip(names, values)), 60_000)
    assert [bytes(v) for v in plain.get(names)] == [bytes(v) for v in values]
    assert 0 < plain.client.pttl(names[0]) <= 60_000
    direct.put([(names[0], b"again")], None)
    assert plain.client.pttl(names[0]) == -1 and plain.get([names[0]]) == [b"again"]
    with pytest.raises(InvalidInputError, match="not contiguous"):
        direct.put([("kdn:test:strided", memoryview(big)[::2])], None)
    assert plain.delete(names) == len(names)


def test_a_refused_write_is_reported_after_every_reply_and_the_store_keeps_serving(tmp_path):
    """A server out of memory answers SETs with an error: the pipeline reads every reply, raises
    the server's text, and the next calls work; through the tier it is a refused write, counted."""
    from kdn.storage.redis_transport import RedisTransport

    require_redis()
    server = RedisServer(tmp_path / "redis", None, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        transport = RedisTransport(url, 1.0)
        with pytest.raises(RuntimeError, match="OOM"):
            transport.put([(f"kdn:test:full{i}", bytes(1 << 20)) for i in range(4)], None)
        server.cli("CONFIG", "SET", "maxmemory", "0")
        transport.put([("kdn:test:small", b"fits now")], None)
        assert [bytes(v) for v in transport.get(["kdn:test:small"])] == [b"fits now"]
        server.cli("FLUSHALL")
        server.cli("CONFIG", "SET", "maxmemory", "1")
        tier = fresh_tier(url)
        assert tier.put(key(1), blob_for(1), wait=True) is False
        assert tier.stats()["refused"] == 1 and tier.get_many([key(1)]) == [None]
    finally:
        server.stop()


def test_claims_name_one_owner_expire_and_are_released_only_by_it(redis_server):
    """The in-flight hints engines share: a live claim of one owner refuses another's, is renewed by
    its own, is released only by it, and expires by itself (an engine that died holds nothing)."""
    tier = fresh_tier(redis_server.url)
    assert tier.claims.claimant(key(1)) is None
    assert tier.claims.claim(key(1), "engine-a", ttl=30) and not tier.claims.claim(key(1), "engine-b", ttl=30)
    assert tier.claims.claim(key(1), "engine-a", ttl=30) and tier.claims.claimant(key(1)) == "engine-a"
    tier.claims.release(key(1), "engine-b")
    assert tier.claims.claimant(key(1)) == "engine-a"
    tier.claims.release(key(1), "engine-a")
    assert tier.claims.claimant(key(1)) is None and tier.claims.claim(key(1), "engine-b", ttl=0.2)
    time.sleep(0.4)
    assert tier.claims.claimant(key(1)) is None and tier.count_prefix([key(1)]) == 0  # a claim is not a chunk


def test_a_won_claim_covers_the_chunks_its_owner_computes_after_it(redis_server):
    """``also``: the chunks after the first are claimed with it when it wins (an engine that finds
    the first stored and the rest on their way sees them claimed), and not when it loses."""
    tier = fresh_tier(redis_server.url)
    assert tier.claims.claim(key(11), "engine-a", ttl=30, also=[key(12), key(13)])
    assert [tier.claims.claimant(key(i)) for i in (11, 12, 13)] == ["engine-a"] * 3
    assert not tier.claims.claim(key(12), "engine-b", ttl=30, also=[key(13)])
    assert not tier.claims.claim(key(11), "engine-b", ttl=30, also=[key(14)]) and tier.claims.claimant(key(14)) is None
    assert tier.claims.claim(key(11), "engine-a", ttl=0.2, also=[key(12), key(13)])  # renewed, shorter
    time.sleep(0.4)
    assert [tier.claims.claimant(key(i)) for i in (11, 12, 13)] == [None] * 3


def test_of_owners_claiming_at_once_exactly_one_wins(redis_server):
    """Claims are taken at lookup by engines asked the same document in the same instant: on a
    Redis store (SET NX) exactly one of them wins, however the calls interleave."""
    import threading

    tier = fresh_tier(redis_server.url)
    for round_ in range(5):
        won, start, chunk = [], threading.Barrier(8), key(100 + round_)

        def claim(owner, start=start, won=won, chunk=chunk):
            start.wait()
            if tier.claims.claim(chunk, owner, ttl=30):
                won.append(owner)

        threads = [threading.Thread(target=claim, args=(f"engine-{i}",)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and tier.claims.claimant(key(100 + round_)) == won[0]


def test_the_store_tells_its_evictions_expiries_and_deletes_of_what_this_process_filed(tmp_path):
    """KV events of a remote tier (issue 64): every blob this process wrote is announced once, a blob
    another process wrote first is not, and every removal of an announced blob is told by the store
    itself, whoever made it: LRU evictions under maxmemory, an expiry, another process's delete;
    what the events leave held is exactly what the store holds."""
    require_redis()
    server = RedisServer(tmp_path / "redis", None, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru",
                         "--notify-keyspace-events", "Egx")  # the operator's setting (kdn adds 'e' only if told)
    try:
        tier, other = fresh_tier(server.url, options={"configure_events": True}), RemoteTier(server.url)
        tier.record_events(True)
        assert "e" in server.cli("CONFIG", "GET", "notify-keyspace-events").stdout.split()[-1]
        other.put(key(100), blob_for(100, 1024), wait=True)
        tier.put(key(100), blob_for(100, 1024), wait=True)  # found there: another process's announcement
        for i in range(24):  # ~260 KB each: the store evicts the least recent
            tier.put(key(i), blob_for(i, 1024), wait=True)
        tier.flush()
        events = tier.take_events()
        stored = [k for s, k in events if s]
        removed = [k for s, k in events if not s]
        assert stored == [key(i) for i in range(24)]
        assert removed and len(set(removed)) == len(removed) and set(removed) <= set(stored)
        held = set(stored) - set(removed)
        assert held == {key(i) for i in range(24) if tier.contains(key(i))}
        deleted, expiring = sorted(held)[:2]
        assert other.remove(deleted)
        tier.transport.client.pexpire(tier.redis_key(expiring), 50)
        time.sleep(0.3)
        assert not tier.contains(expiring)  # (an access expires it now if the server has not yet)
        tier.flush()
        assert sorted(tier.take_events()) == sorted([(False, deleted), (False, expiring)])
        tier.put(key(0), blob_for(0, 1024), wait=True)  # evicted earlier: written, announced again
        tier.flush()
        assert (True, key(0)) in tier.take_events()
        tier.record_events(False)
        tier.put(key(1), blob_for(1, 1024), wait=True)
        assert tier.take_events() == []
    finally:
        server.stop()


def test_kv_events_never_reconfigure_a_server_kdn_was_not_told_it_owns(tmp_path, caplog):
    """Issue 80's probe: KV events ran ``CONFIG SET notify-keyspace-events`` on any server. Without
    ``configure_events`` kdn only reads the setting: a server without the flags keeps its own (one
    warning names it), and this process's own writes and deletes are still announced."""
    require_redis()
    server = RedisServer(tmp_path / "redis", None)
    try:
        before = server.cli("CONFIG", "GET", "notify-keyspace-events").stdout
        with caplog.at_level("WARNING", logger="kdn"):
            tier = fresh_tier(server.url)
            tier.record_events(True)
            tier.put(key(1), blob_for(1), wait=True)
            assert tier.remove(key(1))
        assert server.cli("CONFIG", "GET", "notify-keyspace-events").stdout == before
        assert any("notify-keyspace-events" in r.getMessage() and "configure_events" in r.getMessage()
                   for r in caplog.records)
        assert tier.take_events() == [(True, key(1)), (False, key(1))]
    finally:
        server.stop()


def test_a_store_that_cannot_tell_its_removals_announces_this_processs_own():
    """A transport without removal notifications (Mooncake's): what this process files and removes
    is announced, and ``watching`` says the store's own evictions are not."""
    from types import SimpleNamespace

    from kdn.storage.remote_events import RemoteEvents

    events = RemoteEvents(SimpleNamespace(watch_removals=lambda removed: None))
    assert not events.watching and events.sync()
    events.filed([key(1), key(2), key(1)])
    events.removed(key(1))
    events.removed(key(3))  # never filed here: nothing to announce
    events.cleared()
    assert events.take() == [(True, key(1)), (True, key(2)), (False, key(1)), (False, key(2))]
