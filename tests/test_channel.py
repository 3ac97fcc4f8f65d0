"""The scheduler-to-worker lookup channel (kdn.engine.channel, its typed messages kdn.engine.messages):
answers come from the worker's lookup, a dead or failing worker is "no answer" (the scheduler then
asks its own tiers), the socket lives in a folder only its user can open, and a frame that is not
the channel's is refused unread."""

import os
import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest

import kdn
from kdn.engine import Prefix, channel, messages
from kdn.engine.channel import LookupClient, LookupServer, WorkerNotServing, socket_path
from kdn.engine.messages import Readiness
from kdn.engine.requests import request_digest
from kdn.keys import request_scope


def held(n: int, last_tokens: int = 0) -> Prefix:
    """What a worker's lookup finds: n tokens in chunks of 16, each key naming its chunk, each held by
    one of the worker's tiers (its hit's CacheHitSource travels with the answer)."""
    keys = [bytes([i]) * 16 for i in range(-(-n // 16))]
    return Prefix(keys, n, last_tokens, tuple(("memory", "disk", "node", "")[i % 4] for i in range(len(keys))))


def tokens_of(found) -> int | None:
    return None if found is None else found.tokens


@pytest.fixture
def runtime_dir(monkeypatch):
    """A private ``$XDG_RUNTIME_DIR`` short enough for a socket's path (a test worker's tmp_path may not be)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="kdn-run-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", folder)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def test_a_runtime_folder_too_long_for_a_socket_gives_way_to_tmp(tmp_path, monkeypatch):
    """A socket's path holds at most 107 bytes: under a deep ``$XDG_RUNTIME_DIR`` the lookup socket
    goes to ``/tmp/kdn-<uid>`` (the same for the scheduler and the worker) and can be served there."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    path = socket_path("engine-long|store")
    assert path == socket_path("engine-long|store") and len(path.encode()) <= 107
    assert os.path.dirname(path) == f"/tmp/kdn-{os.getuid()}"
    server = LookupServer(path, lambda tokens, limit, scope: held(32))
    client = LookupClient(path)
    try:
        assert tokens_of(client.lookup(np.arange(40), 39)) == 32
    finally:
        client.close()
        server.close()


def test_the_worker_answers_and_a_gone_or_failing_worker_is_no_answer(runtime_dir, monkeypatch):
    path = socket_path("engine-a|store")
    assert path != socket_path("engine-b|store")  # one socket per vLLM engine and store
    seen = []

    def lookup(tokens, limit, scope):
        seen.append((tokens.tolist(), limit))
        if scope is not None:
            return held(scope[0] % 16 + 1)
        if limit == 13:
            raise RuntimeError("the worker's tiers failed")
        if limit == 36:
            return held(36, last_tokens=20)  # the last chunk shared in part, through a pointer
        return held(min(limit, 16 * (len(tokens) // 16)))

    client = LookupClient(path, timeout=1.0)
    assert client.lookup(np.arange(40), 39) is None  # no worker yet
    long_ids = ["x" * 2000, "é" * 600 + "a", "é" * 600 + "b"]  # past any bound; cut inside a character
    ended = [["req-1", "req-é"], [], [], [], long_ids]  # the stores that ended before each answer
    server = LookupServer(path, lookup, lambda: ended.pop(0) if ended else [])
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert client.lookup(np.arange(40), 39) == held(32) and tokens_of(client.lookup(np.arange(5), 4)) == 0
    assert client.take_ended() == [request_digest("req-1"), request_digest("req-é")]  # told with the answers
    assert client.take_ended() == []
    assert client.lookup(np.arange(40), 36) == held(36, last_tokens=20)  # the keys travel: the load reads them
    assert seen[0] == (list(range(40)), 39)
    scope = request_scope("tenant-b")
    assert tokens_of(client.lookup(np.arange(40), 39, scope)) == scope[0] % 16 + 1  # the request's scope reaches it
    assert client.lookup(np.arange(40), 13) is None  # the worker's lookup raised: no answer
    assert client.take_ended() == [request_digest(i) for i in long_ids]  # told even then; each id whole
    other = LookupClient(path, timeout=1.0)  # a second client of the worker: told every ended store too
    assert tokens_of(other.lookup(np.arange(5), 4)) == 0
    assert other.take_ended() == [request_digest(i) for i in ["req-1", "req-é", *long_ids]]
    assert client.take_ended() == []  # not told twice
    other.close()
    assert tokens_of(client.lookup(np.arange(100), 99)) == 96  # and it keeps serving
    server.close()
    assert client.lookup(np.arange(40), 39) is None
    restarted = LookupServer(path, lookup)  # a restarted worker: the client reconnects
    assert tokens_of(client.lookup(np.arange(70), 69)) == 64
    restarted.serving = False  # its worker refused vLLM's KV layout: the scheduler is told, not sent a miss
    with pytest.raises(WorkerNotServing, match="refused"):
        client.lookup(np.arange(70), 69)
    client.close()
    restarted.close()


@pytest.mark.parametrize("squat", ["another user's folder", "a symlink to another folder"])
def test_a_folder_another_user_made_first_is_never_used(runtime_dir, tmp_path, monkeypatch, squat):
    """Another local user who creates ``kdn-<uid>`` first (or a symlink by that name) would receive
    the scheduler's prompts and answer its lookups: the socket goes to a private folder instead."""
    if os.getuid() != 0 and squat == "another user's folder":
        pytest.skip("making a folder owned by another user needs root")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    squatted = runtime_dir / f"kdn-{os.getuid()}"
    if squat == "a symlink to another folder":
        (tmp_path / "theirs").mkdir(mode=0o777)
        squatted.symlink_to(tmp_path / "theirs")
    else:
        squatted.mkdir(mode=0o777)
        os.chown(squatted, 65534, 65534)
    path = socket_path("engine-a|store")
    assert os.path.dirname(path) == str(tmp_path / "home" / ".cache" / "kdn" / "run")
    assert stat.S_IMODE(os.lstat(os.path.dirname(path)).st_mode) == 0o700
    assert path == socket_path("engine-a|store")  # the scheduler and the worker derive the same


def test_an_answer_beyond_the_limit_is_clamped_and_a_silent_connection_dropped(runtime_dir, monkeypatch):
    monkeypatch.setattr(channel, "IDLE_S", 0.3)
    path = socket_path("engine-a|store")
    server = LookupServer(path, lambda tokens, limit, scope: held(5))
    client = LookupClient(path, timeout=1.0)
    assert tokens_of(client.lookup(np.arange(6), 5)) == 5
    clamped = LookupServer(socket_path("engine-b|store"), lambda tokens, limit, scope: Prefix([b"k" * 16], 4096))
    flood = LookupServer(socket_path("engine-c|store"), lambda tokens, limit, scope: held(4096))
    asking = [LookupClient(socket_path(f"engine-{name}|store"), timeout=1.0) for name in "bc"]
    assert tokens_of(asking[0].lookup(np.arange(6), 5)) == 5  # more than it was asked: clamped
    assert asking[1].lookup(np.arange(6), 5) is None  # 256 keys for 5 tokens: not a reply of kdn's
    for closing in (*asking, clamped, flood):
        closing.close()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.settimeout(5)
    silent.connect(path)
    start = time.monotonic()
    assert silent.recv(1) == b"" and time.monotonic() - start < 2  # dropped by the server
    time.sleep(0.5)  # the client's kept connection went idle too: it reconnects, one answer
    assert tokens_of(client.lookup(np.arange(6), 5)) == 5
    silent.close()
    client.close()
    server.close()


def test_idle_connections_never_lock_the_scheduler_out_and_long_requests_are_bounded(runtime_dir, monkeypatch):
    """Issue 62: ``MAX_CONNECTIONS`` idle connections (another process of this user) make room for a
    new one (the one idle longest is closed), and a request over ``MAX_TOKENS`` is dropped unread."""
    monkeypatch.setattr(channel, "MAX_CONNECTIONS", 8)
    path = socket_path("engine-a|store")
    server = LookupServer(path, lambda tokens, limit, scope: held(min(limit, 16)))
    idle = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        idle.append(s)
    time.sleep(0.2)
    client = LookupClient(path, timeout=2.0)
    assert tokens_of(client.lookup(np.arange(40), 39)) == 16  # served: an idle one made room
    idle[0].settimeout(2)
    assert idle[0].recv(1) == b""  # the oldest idle connection was closed
    huge = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    huge.settimeout(2)
    huge.connect(path)
    huge.sendall(messages.FRAME.pack(messages.VERSION, messages.Lookup.KIND, messages.Lookup.bound() + 4))
    assert huge.recv(1) == b""  # dropped before a byte of its tokens was read
    for s in (*idle, huge):
        s.close()
    client.close()
    server.close()


def test_each_tensor_parallel_rank_holds_its_share_of_the_heads_as_vllm_splits_them():
    """vLLM's ``QKVParallelLinear``: ``total // ranks`` heads a rank, or each head over ``ranks // total``
    ranks when there are fewer heads than ranks; an MLA latent is every rank's whole. Each share is
    keyed apart (the whole model's fingerprint for one holding every head)."""
    from kdn.engine.layout import ModelLayout
    from kdn.integrations.vllm.ranks import Rank
    from kdn.keys import shard_fingerprint

    gqa, latent = ModelLayout(4, 4, 64, "float32", 100), ModelLayout(4, 1, 288, "bfloat16", 100, latent=True)
    assert [Rank.of(gqa, r, 2).heads for r in range(2)] == [(0, 2), (2, 2)]
    assert [Rank.of(gqa, r, 8).heads for r in range(8)] == [(i // 2, 1) for i in range(8)]
    assert [Rank.of(latent, r, 4).heads for r in range(4)] == [None] * 4 and Rank.of(latent, 3, 4).keys_shared
    assert Rank.of(gqa, 0, 1) == Rank() and not Rank.of(gqa, 1, 2).keys_shared
    fp = bytes(range(16))
    shares = {shard_fingerprint(fp, first, n, 4) for first, n in ((0, 2), (2, 2), (0, 1), (1, 1))}
    assert len(shares) == 4 and fp not in shares and shard_fingerprint(fp, 0, 4, 4) == fp
    for first, n in ((3, 2), (-1, 1), (0, 0)):
        with pytest.raises(kdn.InvalidInputError, match="not a shard"):
            shard_fingerprint(fp, first, n, 4)


def test_the_scheduler_asks_every_rank_and_a_hit_is_what_all_of_them_hold(runtime_dir):
    """A tensor-parallel engine's worker per rank answers for its own share: the hit is the least of
    theirs; a rank that does not answer is no answer; a store has ended once every rank said so; a
    rank that refused the engine refuses it for all."""
    from kdn.integrations.vllm.ranks import RankLookups

    paths = [socket_path(f"engine-tp|store|rank {r}") for r in range(2)]
    ended = [[["req-1", "req-2"]], [["req-2"], ["req-1"]]]  # what each rank says has ended, answer by answer
    servers = [LookupServer(path, lambda tokens, limit, scope, n=n: held(n), lambda r=r: ended[r].pop(0)
                            if ended[r] else []) for r, (path, n) in enumerate(zip(paths, (48, 32)))]
    asked = RankLookups(paths)
    try:
        assert asked.lookup(np.arange(60), 59) == held(32)  # rank 1 holds less
        assert asked.take_ended() == [request_digest("req-2")]  # rank 1 has not said req-1 yet
        assert tokens_of(asked.lookup(np.arange(60), 59)) == 32
        assert asked.take_ended() == [request_digest("req-1")]
        servers[1].serving = False
        with pytest.raises(WorkerNotServing):
            asked.lookup(np.arange(60), 59)
        servers[1].close()
        assert asked.lookup(np.arange(60), 59) is None  # the scheduler asks its own tiers
    finally:
        asked.close()
        for server in servers:
            server.close()


def test_a_blend_query_carries_the_workers_readiness_and_its_held_pieces_between_lookups(runtime_dir):
    """The scheduler of a multiprocess engine asks the worker's socket whether it blends and how many
    of a prompt's pieces its tiers hold; lookups on the same connection still answer, a worker that
    refused the engine (or whose answer failed) says it does not blend, and a gone one is no answer."""
    path = socket_path("engine-blend|store")
    held_keys = {bytes([i]) * 16 for i in range(3)}
    asked = []

    def readiness(keys):
        asked.append(keys)
        if len(keys) == 7:
            raise RuntimeError("the worker's tiers failed")
        held = next((i for i, k in enumerate(keys) if k not in held_keys), len(keys))
        return Readiness(True, vouched=len(keys) != 5, held=held)

    server = LookupServer(path, lambda tokens, limit, scope: held(32), readiness=readiness)
    client = LookupClient(path, timeout=1.0)
    try:
        keys = [bytes([i]) * 16 for i in range(4)]
        assert client.readiness(keys) == Readiness(True, True, 3, None) and asked[-1] == keys
        assert tokens_of(client.lookup(np.arange(40), 39)) == 32  # a lookup between two queries
        assert client.readiness(keys[:1] + keys[3:] + keys[1:3]) == Readiness(True, True, 1, None)
        assert client.readiness([bytes([9]) * 16] + keys) == Readiness(True, False, 0, None)  # 5: not vouched
        failed = client.readiness(keys + keys[:3])
        assert not failed.blends and "the worker's tiers failed" in failed.why
        assert client.readiness([b"short"]).blends is False and len(asked) == 4  # never sent
        server.serving = False
        assert client.readiness(keys) == Readiness(False, False, 0, "the worker refused this engine's KV layout")
    finally:
        server.close()
    assert client.readiness(keys) is None  # nobody listens
    client.close()
    silent = LookupServer(path, lambda tokens, limit, scope: held(32))  # a server that cannot blend says so
    asker = LookupClient(path)
    try:
        assert asker.readiness(keys) == Readiness(False, why="no blending")
    finally:
        asker.close()
        silent.close()


def test_every_message_reads_back_as_sent_and_a_frame_not_of_this_channel_is_refused_unread(runtime_dir):
    """The typed protocol: each message encodes and decodes to itself; a frame of another version, of
    a kind not asked for, or whose body is not its kind's shape ends its connection (the asker then
    asks its own tiers), and the server keeps serving others."""
    sent = [messages.Lookup(np.arange(7, dtype=np.uint32), 6, request_scope("t")), messages.Lookup(np.arange(3), 2),
            messages.LookupAnswer(messages.FOUND, held(40, 8), (request_digest("a"),)),
            messages.LookupAnswer(messages.NOT_SERVING), messages.BlendQuery((b"k" * 16, b"j" * 16)),
            Readiness(True, False, 1, "why"), Readiness(False)]
    for message in sent:
        body = messages.frame(message)[messages.FRAME.size:]
        back = (message.decode(body, 40) if isinstance(message, messages.LookupAnswer) else message.decode(body))
        if isinstance(message, messages.Lookup):
            assert back.tokens.tolist() == list(message.tokens) and (back.limit, back.scope) == (message.limit,
                                                                                                message.scope)
        else:
            assert back == message
    for bad in (messages.Lookup.decode, messages.BlendQuery.decode, Readiness.decode):
        with pytest.raises(messages.ProtocolError):
            bad(b"\x01\x02\x03")
    path = socket_path("engine-proto|store")
    server = LookupServer(path, lambda tokens, limit, scope: held(16))
    client = LookupClient(path, timeout=1.0)
    try:
        for head in (messages.FRAME.pack(messages.VERSION + 1, messages.Lookup.KIND, 0),  # another kdn
                     messages.FRAME.pack(messages.VERSION, messages.LookupAnswer.KIND, 0),  # not a request
                     messages.FRAME.pack(messages.VERSION, messages.BlendQuery.KIND, 5) + b"\x09" * 5):  # no shape
            rogue = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            rogue.settimeout(2)
            rogue.connect(path)
            rogue.sendall(head)
            assert rogue.recv(1) == b""  # dropped, nothing answered
            rogue.close()
        assert tokens_of(client.lookup(np.arange(40), 39)) == 16  # still serving
    finally:
        client.close()
        server.close()
