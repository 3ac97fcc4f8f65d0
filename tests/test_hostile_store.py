"""A shared store may be down or hostile: kdn degrades to "no cache", never to "no service" (issue 46).

A store that cannot be used makes claims "cannot tell" (compute now), never "wait"; a claim kdn
would not write holds no one; a value planted under a chunk's name is a counted corrupt miss of that
chunk alone, bounded in memory and time, and replaced by the next store; a server that trickles,
floods or answers out of turn is cut off at the call's deadline, its replies never reaching the
wrong request.
"""

import os
import signal
import struct
import time

import pytest
import torch

from conftest import full_prefill, random_ids
from disk_helpers import blob_for, key
from hostile_resp import HostileRedis
from kdn import KDN, KDNConfig, _core
from kdn.storage.remote import RemoteTier
from kdn.storage.transport import open_transport
from redis_servers import RedisServer, require_redis

CHUNK = 8
TIMEOUT = 1.0
MiB = 1 << 20


def rss() -> int:
    """This process' resident memory now (bytes)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def fresh_tier(url, **kw) -> RemoteTier:
    tier = RemoteTier(url, **kw)
    tier.clear()
    return tier


# -- a server that answers badly ------------------------------------------------------------------
def test_a_trickling_server_is_cut_off_at_the_calls_deadline():
    """``timeout`` bounds a call, not each recv: a reply sent one byte every 0.2 s (20 s for this
    value) ends the call at the deadline, for one key or several, and closes the connection."""
    with HostileRedis("trickle", delay=0.2) as server:
        server.values[b"k1"] = server.values[b"k2"] = b"x" * 100
        conn = _core.RespConnection("127.0.0.1", server.port, timeout=TIMEOUT)
        for names in (["k1"], ["k1", "k2", "k1"]):
            if not conn.open:
                conn = _core.RespConnection("127.0.0.1", server.port, timeout=TIMEOUT)
            start = time.monotonic()
            with pytest.raises(ConnectionError, match="timed out"):
                conn.get_many(names)
            assert time.monotonic() - start < TIMEOUT * 1.1 and not conn.open
        tier = RemoteTier(server.url, timeout=TIMEOUT)
        start = time.monotonic()
        assert tier.get_many([key(1), key(2), key(3)]) == [None] * 3
        assert time.monotonic() - start < TIMEOUT * 1.1 and tier.stats()["state"] == "down"


def test_a_server_that_answers_ping_but_drips_its_values_stays_skipped():
    """Issue 62: the breaker probes with a small read, not a PING alone: a store that answers PING
    at once but drips GETs is not brought back every probe (callers would lose a timeout each
    time); once it answers reads again, it is."""
    with HostileRedis("honest", delay=0.2) as server:
        tier = RemoteTier(server.url, timeout=TIMEOUT, retry_seconds=0.05)
        server.mode = "trickle"
        assert tier.get_many([key(1)]) == [None] and tier.stats()["state"] == "down"
        time.sleep(10 * 0.05 + 2 * TIMEOUT)
        assert tier.stats()["state"] == "down" and tier.stats()["errors"] == 1
        server.mode = "honest"
        deadline = time.monotonic() + 2 * TIMEOUT + 1.0
        while tier.stats()["state"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.stats()["state"] == "ok"


def test_lookups_and_claims_on_a_trickling_server_end_at_the_deadline_too():
    """EXISTS (every lookup) and claims go through the same client as reads: a server that starts
    trickling after start-up costs a lookup or a claim the timeout, not the trickle (a byte every
    0.5 s: at least 2 s a reply, against a bound of 1.5x the 1 s timeout, which a loaded 2-core
    machine overshot by 0.6 s once at 1.1x)."""
    with HostileRedis("honest", delay=0.5) as server:
        tier = RemoteTier(server.url, timeout=TIMEOUT)
        assert tier.stats()["state"] == "ok"
        server.mode = "trickle"
        start = time.monotonic()
        assert tier.present([key(1), key(2), key(3)]) == [False] * 3
        assert time.monotonic() - start < TIMEOUT * 1.5 and tier.stats()["state"] == "down"
    with HostileRedis("honest", delay=0.5) as server:
        tier = RemoteTier(server.url, timeout=TIMEOUT)
        server.mode = "trickle"
        start = time.monotonic()
        assert tier.claims.claim(key(1), "engine-a", ttl=5) is None
        assert time.monotonic() - start < TIMEOUT * 1.5


def test_a_reply_line_without_an_end_is_cut_off_in_bounded_memory():
    with HostileRedis("long-line", line_bytes=256 * MiB) as server:
        conn = _core.RespConnection("127.0.0.1", server.port, timeout=5.0)
        before = rss()
        with pytest.raises(ConnectionError, match="longer than 4096 bytes"):
            conn.get_many(["k"])
        assert rss() - before < 16 * MiB and not conn.open


def test_a_reply_longer_than_was_asked_is_refused_before_it_is_read():
    with HostileRedis("huge-bulk") as server:
        server.values[b"k"] = b"small"
        conn = _core.RespConnection("127.0.0.1", server.port, timeout=5.0)
        before = rss()
        with pytest.raises(ConnectionError, match=r"1073741824 bytes to a request for at most 1001"):
            conn.get_many(["k"], max_bytes=1000)
        assert rss() - before < 16 * MiB
        conn = _core.RespConnection("127.0.0.1", server.port, timeout=5.0)
        with pytest.raises(ConnectionError, match="for at most 10"):  # a byte range is bounded by its length
            conn.get_ranges([("k", 0, 9)])


def test_a_reply_nobody_asked_for_never_answers_the_next_request():
    """One extra reply to a GET: the connection that holds it is out of step, refuses to be used
    (and the transport's pool drops it), so the next key gets its own value, never the last one's."""
    with HostileRedis("extra-reply") as server:
        server.values.update({b"a": b"value of a", b"b": b"value of b", b"c": b"value of c"})
        conn = _core.RespConnection("127.0.0.1", server.port, timeout=TIMEOUT)
        assert [bytes(v) for v in conn.get_many(["a"])] == [b"value of a"]
        time.sleep(0.2)
        assert not conn.in_step
        with pytest.raises(ConnectionError, match="out of step"):
            conn.get_many(["b"])
        transport = open_transport(server.url, timeout=TIMEOUT)
        for name in ("a", "b", "c", "a"):
            assert [bytes(v) for v in transport.get([name])] == [b"value of " + name.encode()]
            time.sleep(0.2)


# -- a store that is down -------------------------------------------------------------------------
def test_an_outage_makes_a_claim_unknown_never_held(tmp_path):
    """With the store stopped (SIGSTOP: connections hang), a claim answers None ("cannot tell":
    the caller computes) within the timeout, then at once while the breaker is open; a live claim
    of another owner is False, which is the only answer that makes anyone wait."""
    require_redis()
    server = RedisServer(tmp_path / "redis")
    try:
        tier = RemoteTier(server.url, timeout=0.3, retry_seconds=30)
        assert tier.claims.claim(key(1), "engine-a", ttl=5) is True
        assert tier.claims.claim(key(1), "engine-b", ttl=5) is False
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert tier.claims.claim(key(1), "engine-b", ttl=5) is None
            assert time.monotonic() - start < 0.3 * 1.1 + 0.1
            start = time.monotonic()
            assert tier.claims.claim(key(2), "engine-b", ttl=5) is None and time.monotonic() - start < 0.05
            assert tier.stats()["state"] == "down" and tier.claims.claimant(key(1)) is None
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    finally:
        server.stop()


def test_an_outage_costs_the_callers_one_timeout_and_a_probe_finds_the_store_back(tmp_path):
    """After the first call that times out, no caller waits on a stopped store again (a background
    thread probes it every ``retry_seconds`` instead of a caller's call); when it is back, the next
    probe closes the breaker and reads hit again."""
    require_redis()
    server = RedisServer(tmp_path / "redis")
    try:
        tier = RemoteTier(server.url, timeout=0.3, retry_seconds=0.4)
        assert tier.put(key(1), blob_for(1), wait=True)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            waits = []
            end = time.monotonic() + 1.5  # several probe periods
            while time.monotonic() < end:
                start = time.monotonic()
                assert tier.get_many([key(1)]) == [None]
                waits.append(time.monotonic() - start)
                time.sleep(0.05)
            assert waits[0] < 0.3 * 1.1 + 0.1 and max(waits[1:]) < 0.05 and tier.stats()["state"] == "down"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 0.4 + 0.3 + 1.0
        while tier.stats()["state"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.stats()["state"] == "ok" and bytes(tier.get_many([key(1)])[0]) == bytes(blob_for(1))
    finally:
        server.stop()


# -- values planted in a shared store -------------------------------------------------------------
@pytest.mark.parametrize("forge", ["no ttl", "a day", "not utf-8", "too long an owner"])
def test_a_claim_kdn_would_not_write_holds_no_one(redis_server, forge):
    tier = fresh_tier(redis_server.url)
    name = tier.claims.name(key(1))
    value, ttl = {"no ttl": (b"intruder", None), "a day": (b"intruder", 86_400_000),
                  "not utf-8": (b"\xff\xfe\xfd", 5000), "too long an owner": (b"x" * 300, 5000)}[forge]
    tier.transport.client.set(name, value, px=ttl)
    start = time.monotonic()
    assert tier.claims.claim(key(1), "engine-a", ttl=5) is True and tier.claims.claimant(key(1)) == "engine-a"
    assert time.monotonic() - start < TIMEOUT
    stats = tier.stats()
    assert stats["bad_claims"] == 1 and stats["state"] == "ok" and stats["errors"] == 0
    assert 0 < int(redis_server.cli("PTTL", name).stdout) <= 5000


def test_with_a_secret_a_claim_written_without_it_holds_no_one(redis_server):
    """Issue 62: in keyed mode a claim carries a tag of its name and owner; "mallory" writing a
    claim as an unkeyed kdn would (a printable owner, a 5 s lease) is not honoured (removed), while
    another keyed engine's claim is."""
    from kdn.storage.remote import RemoteTier

    secret = KDNConfig(secret="the fleet's secret").mac_key()
    keyed = RemoteTier(redis_server.url, timeout=TIMEOUT, mac_key=secret)
    keyed.clear()
    name = keyed.claims.name(key(2))
    keyed.transport.client.set(name, b"mallory", px=5000)
    assert keyed.claims.claim(key(2), "engine-a", ttl=5) is True and keyed.stats()["bad_claims"] == 1
    other = RemoteTier(redis_server.url, timeout=TIMEOUT, mac_key=secret)
    assert other.claims.claim(key(2), "engine-b", ttl=5) is False  # engine-a's signed claim holds
    assert other.claims.claimant(key(2)) == "engine-a"
    plain = RemoteTier(redis_server.url, timeout=TIMEOUT)
    assert plain.claims.claimant(key(2)) is None  # unkeyed readers do not take a tagged value for an owner


def manifest(parts: int, total: int) -> bytes:
    return struct.pack("<4sIIQ", b"KDNM", 2, parts, total)


PLANTED = {
    "8 bytes of manifest magic": b"KDNM\0\0\0\0",
    "2^32-1 parts": manifest(2**32 - 1, 2**64 - 1),
    "2M parts of a small total": manifest(2_000_000, 64 * MiB),
    "3 parts of 1 GiB": manifest(3, 1 << 30),
    "40 MiB of garbage": b"\x07" * (40 * MiB),
    "42 bytes of garbage": b"g" * 42,
}


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "keyed"])
@pytest.mark.parametrize("planted", list(PLANTED))
def test_a_planted_value_is_a_corrupt_miss_of_its_chunk_alone(redis_server, planted, secret):
    """Whatever bytes sit under a chunk's name, that chunk is a miss counted ``corrupt``; its
    neighbours in the same read hit, the tier stays up, and the read costs < 64 MiB and the timeout."""
    tier = fresh_tier(redis_server.url, timeout=TIMEOUT, mac_key=bytes(range(32)) if secret else b"")
    for i in range(3):
        assert tier.put(key(i), blob_for(i), wait=True)
    tier.transport.put([(tier.redis_key(key(0)), PLANTED[planted])], None)
    before, start = rss(), time.monotonic()
    got = tier.get_many([key(0), key(1), key(2)])
    assert time.monotonic() - start < TIMEOUT * 1.1 and rss() - before < 64 * MiB
    assert got[0] is None and [bytes(b) for b in got[1:]] == [bytes(blob_for(i)) for i in (1, 2)]
    stats = tier.stats()
    assert stats["corrupt"] == 1 and stats["state"] == "ok" and stats["errors"] == 0
    assert tier.remove(key(0))


def test_a_bad_value_is_replaced_by_the_next_store_and_an_honest_one_never(redis_server):
    """A reader that finds garbage under a chunk's name remembers it; its next store of that chunk
    replaces it (compare-and-set). A valid value another writer put there in between is kept."""
    tier = fresh_tier(redis_server.url)
    name = tier.redis_key(key(3))
    redis_server.cli("SET", name, "g" * 42)
    assert tier.get_many([key(3)]) == [None]
    assert tier.put(key(3), blob_for(3), wait=True)
    assert bytes(tier.get_many([key(3)])[0]) == bytes(blob_for(3)) and tier.stats()["replaced"] == 1

    name = tier.redis_key(key(4))
    redis_server.cli("SET", name, "g" * 42)
    assert tier.get_many([key(4)]) == [None]
    honest = bytes(blob_for(4, tokens=8))  # another writer's valid value for the same chunk
    tier.transport.client.set(name, honest)
    assert tier.put(key(4), blob_for(4), wait=True)
    assert bytes(tier.get_many([key(4)])[0]) == honest and tier.stats()["replaced"] == 1


def test_a_planted_value_costs_its_prompt_one_miss_and_no_other_prompt_anything(tiny_llama, redis_server):
    """End to end: 8 bytes under the first chunk of prompt A; a new reader still hits all of
    prompt B, misses A, computes A exactly (a full prefill's logits) and stores it over the bad
    value, after which every reader hits A exactly."""
    config = KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url)  # each KDN: its own empty memory
    writer = KDN(config)
    writer.remote.clear()
    a, b = random_ids(tiny_llama, 6 * CHUNK + 1, seed=11), random_ids(tiny_llama, 6 * CHUNK + 1, seed=12)
    for ids in (a, b):
        writer.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    writer.flush()
    first = writer.chunk_keys(tiny_llama, a)[0]
    writer.remote.transport.put([(writer.remote.redis_key(first), b"KDNM\0\0\0\0")], None)

    reader = KDN(config)
    assert reader.retrieve(tiny_llama, b)[1] == 6 * CHUNK and reader.retrieve(tiny_llama, a)[1] == 0
    reader.memory.clear()  # B's chunks, promoted: A's generate below reads the remote tier again
    expected = tiny_llama.generate(a, max_new_tokens=4, do_sample=False)
    assert torch.equal(reader.generate(tiny_llama, a, max_new_tokens=4, do_sample=False), expected)
    reader.flush()
    stats = reader.stats()["remote"]
    assert stats["state"] == "ok" and stats["corrupt"] >= 1 and stats["replaced"] == 1

    third = KDN(config)
    kv, hit = third.retrieve(tiny_llama, a, limit=a.shape[1] - 1)
    assert hit == 6 * CHUNK
    with torch.inference_mode():
        logits = tiny_llama(a[:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, full_prefill(tiny_llama, a)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delivery", ["layerwise", "whole"])
def test_a_planted_value_is_repaired_by_the_first_generate_on_either_delivery(tiny_llama, redis_server, delivery):
    """Issue 62: 42 bytes under a prompt's first chunk; the first generate (layer-wise streams, the
    default, read values in ranges) counts it corrupt, computes the prompt and replaces the value;
    the next reader is served the whole prompt, a full prefill's logits."""
    config = KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url, delivery=delivery)
    writer = KDN(config)
    writer.remote.clear()
    a = random_ids(tiny_llama, 6 * CHUNK + 1, seed=13)
    writer.store(tiny_llama, a, full_prefill(tiny_llama, a)[1])
    writer.flush()
    first = writer.chunk_keys(tiny_llama, a)[0]
    writer.remote.transport.put([(writer.remote.redis_key(first), b"x" * 42)], None)
    reader = KDN(config)
    reader.generate(tiny_llama, a, max_new_tokens=2, do_sample=False)
    reader.flush()
    stats = reader.stats()["remote"]
    assert reader.last_generate["hit_tokens"] == 0 and stats["corrupt"] == 1 and stats["replaced"] == 1
    kv, hit = KDN(config).retrieve(tiny_llama, a, limit=a.shape[1] - 1)
    assert hit == 6 * CHUNK
    with torch.inference_mode():
        logits = tiny_llama(a[:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, full_prefill(tiny_llama, a)[0], rtol=1e-5, atol=1e-5)
