"""Faults are repaired, not repeated: broken Redis values, stale disk indexes, odd files, exits
(real redis-server, real files, real processes)."""

import os
import resource
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import full_prefill, random_ids
from disk_helpers import blob_for, key
from kdn import KDN, InvalidInputError, KDNConfig, _core
from kdn.storage import DiskTier
from kdn.storage.remote import RemoteTier

CHUNK = 16


def run_python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` in a new process (its exit is a real interpreter exit)."""
    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True, timeout=120)


# -- Redis values split into parts ------------------------------------------------------------------
def test_a_split_value_missing_a_part_is_deleted_and_rewritten(redis_server):
    tier = RemoteTier(redis_server.url, part_bytes=1000)
    blob = blob_for(7, tokens=64)  # ~16 KB: 17 parts behind a manifest
    tier.put(key(7), blob, wait=True)
    name = tier.redis_key(key(7))
    redis_server.cli("DEL", f"{name}:p5")  # what maxmemory + allkeys-lru did to 357 of 752 values
    assert tier.get_many([key(7)]) == [None]
    assert tier.stats()["repaired"] == 1
    assert redis_server.cli("EXISTS", name).stdout.strip() == "0"  # the manifest is gone too
    assert redis_server.cli("EXISTS", f"{name}:p1").stdout.strip() == "0"
    tier.put(key(7), blob, wait=True)  # so the next store is not skipped
    assert bytes(tier.get_many([key(7)])[0]) == bytes(blob)


# -- the disk index stays honest ----------------------------------------------------------------------
EVICTOR = """
import sys
from kdn import _core
from disk_helpers import blob_for, key
store = _core.DiskStore(sys.argv[1], 100 * len(blob_for(0)))     # B on the same folder
for i in range(3):
    store.remove(key(i))                                          # deletes A's files (as its evictions may)
"""


def test_another_process_evicting_our_files_makes_them_misses_and_store_rewrites_them(tmp_path):
    a = _core.DiskStore(str(tmp_path), 100 * len(blob_for(0)))
    for i in range(3):
        assert a.put(key(i), blob_for(i))
    assert a.count_prefix([key(i) for i in range(3)]) == 3
    result = run_python(EVICTOR, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert not any(os.path.exists(a.path_of(key(i))) for i in range(3))  # B deleted them
    assert a.count_prefix([key(i) for i in range(3)]) == 0  # A's lookup no longer claims them
    assert a.stats()["vanished"] >= 1
    assert a.put(key(1), blob_for(1))  # and its store writes again instead of skipping
    assert os.path.exists(a.path_of(key(1))) and bytes(a.get(key(1))) == bytes(blob_for(1))


def test_lookup_never_claims_more_than_retrieve_returns(tiny_llama, tmp_path):
    config = KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path), memory_bytes=1)  # memory holds nothing
    cache = KDN(config)
    ids = random_ids(tiny_llama, 4 * CHUNK + 1, seed=11)
    cache.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    cache.flush()
    assert len(list(tmp_path.glob("??/*.kdnb"))) == 4
    third = cache.chunk_keys(tiny_llama, ids)[2]
    with open(cache.disk.store.path_of(third), "wb"):  # a zero-length file (a crash on a filesystem
        pass                                          # without atomic rename)
    fresh = KDN(config)
    assert fresh.lookup(tiny_llama, ids) == 2 * CHUNK
    assert fresh.retrieve(tiny_llama, ids)[1] == 2 * CHUNK


def test_a_huge_sparse_file_is_rejected_from_its_header(tmp_path):
    store = _core.DiskStore(str(tmp_path), 1 << 40)
    store.put(key(1), blob_for(1))
    path = store.path_of(key(1))
    with open(path, "r+b") as f:
        f.truncate(2 << 30)  # 2 GiB, sparse: its header says a few KB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    assert store.get(key(1)) is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 << 10  # nothing read or allocated
    stats = store.stats()
    assert stats["corrupt"] == 1 and stats["errors"] == 0 and "header says" in stats["last_error"]
    assert not os.path.exists(path)


def test_a_corrupt_read_is_counted_once_and_not_called_a_write_failure(tmp_path, caplog):
    tier = DiskTier(str(tmp_path), 1 << 30)
    tier.put(key(1), blob_for(1), wait=True)
    path = Path(tier.store.path_of(key(1)))
    data = bytearray(path.read_bytes())
    data[300] ^= 1
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="kdn"):
        assert tier.get_many([key(1)]) == [None]
    stats = tier.stats()
    assert (stats["corrupt"], stats["errors"]) == (1, 0)
    assert "corrupt files were dropped" in caplog.text and "writes failed" not in caplog.text


# -- files, directories and symlinks on a shared machine ----------------------------------------------
def test_files_and_directories_are_private_by_default(tmp_path):
    tier = DiskTier(str(tmp_path / "kv"), 1 << 30)
    tier.put(key(1), blob_for(1), wait=True)
    path = tier.store.path_of(key(1))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for d in (tmp_path / "kv", os.path.dirname(path), tmp_path / "kv" / "tmp"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    shared = DiskTier(str(tmp_path / "group"), 1 << 30, group_shared=True)
    shared.put(key(2), blob_for(2), wait=True)
    assert stat.S_IMODE(os.stat(shared.store.path_of(key(2))).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(os.path.dirname(shared.store.path_of(key(2)))).st_mode) == 0o2770


def test_a_directory_of_another_user_is_refused_unless_shared(tmp_path):
    other = tmp_path / "theirs"
    other.mkdir()
    os.chown(other, 4242, 4242)
    with pytest.raises(InvalidInputError, match="belongs to uid 4242.*disk_shared=True"):
        KDN(KDNConfig(disk_dir=str(other)))
    KDN(KDNConfig(disk_dir=str(other), disk_shared=True))  # told to share: accepted


def test_symlinks_inside_the_tier_are_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.kdnb"
    victim.write_bytes(b"not yours")
    tier_dir = tmp_path / "kv"
    store = _core.DiskStore(str(tier_dir), 1 << 30)
    shard = os.path.dirname(store.path_of(key(3)))
    os.symlink(outside, shard)  # a planted shard directory pointing outside
    assert not store.put(key(3), blob_for(3)) and "symlink" in store.stats()["last_error"]
    (outside / os.path.basename(store.path_of(key(3)))).write_bytes(bytes(blob_for(3)))
    assert store.get(key(3)) is None and not store.contains(key(3))
    store.clear()
    assert victim.read_bytes() == b"not yours"  # clear() did not delete through the link
    linked = store.path_of(key(4))
    os.makedirs(os.path.dirname(linked), exist_ok=True)
    os.symlink(victim, linked)  # a planted blob file that is a symlink
    assert store.get(key(4)) is None
    assert victim.read_bytes() == b"not yours"
    reopened = _core.DiskStore(str(tier_dir), 1 << 30)
    assert len(reopened) == 0


NOBODY = 65534  # another local user


def _forged(cache: KDN, model, victim, other) -> dict:
    """Blobs holding ``other``'s KV under ``victim``'s chunk keys (anyone can compute them: keys are
    content-addressed), sealed right: what another local user plants without the secret."""
    cache.store(model, other, full_prefill(model, other)[1])
    blobs = {}
    for mine, theirs in zip(cache.chunk_keys(model, victim), cache.chunk_keys(model, other)):
        blob = bytearray(cache.memory.get(theirs))
        blob[52:68] = mine  # the header's chunk key
        _core.blob_reseal(blob)
        blobs[mine] = bytes(blob)
    return blobs


def _plant(folder: Path, blobs: dict, shard_owner: int | None, file_owner: int) -> None:
    for k, blob in blobs.items():
        shard = folder / k.hex()[:2]
        if not shard.exists():
            shard.mkdir()
            if shard_owner is not None:
                os.chmod(shard, 0o777)
                os.chown(shard, shard_owner, shard_owner)
        path = shard / f"{k.hex()}.kdnb"
        path.write_bytes(blob)
        os.chown(path, file_owner, file_owner)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root (CI runs as root)")
def test_a_node_tier_another_local_user_planted_kv_in_is_never_read(tiny_llama, tmp_path, caplog):
    """Issue 80's probe: another user makes the node folder a symlink to a world-writable sticky
    folder and fills it with 0777 shard folders holding another prompt's KV under the victim's chunk
    names. A fresh victim process refuses that folder by name (the link is another user's; one of
    ours to such a folder is refused too); a node folder of ours that was 0777 is narrowed to 0700
    and what the other user planted in it (shard folders, files) is a miss: the model's own logits."""
    model = tiny_llama
    victim, other = random_ids(model, 3 * CHUNK + 1, seed=21), random_ids(model, 3 * CHUNK + 1, seed=22)
    blobs = _forged(KDN(KDNConfig(chunk_size=CHUNK)), model, victim, other)
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)  # what /dev/shm and /tmp are
    public = shm / "public"
    public.mkdir()
    os.chmod(public, 0o1777)
    _plant(public, blobs, NOBODY, NOBODY)
    (public / "tmp").mkdir(mode=0o777)
    node = shm / "kdn-0"
    node.symlink_to(public)
    os.lchown(node, NOBODY, NOBODY)
    config = KDNConfig(chunk_size=CHUNK, node_dir=str(node))
    with pytest.raises(InvalidInputError, match=f"symlink of uid {NOBODY}"):
        KDN(config)
    os.lchown(node, 0, 0)  # a link of ours to a folder anyone can write: refused too
    with pytest.raises(InvalidInputError, match="writable by other users"):
        KDN(config)

    ours = tmp_path / "node"
    ours.mkdir()
    os.chmod(ours, 0o777)
    planted = dict(list(blobs.items())[:2])
    _plant(ours, planted, NOBODY, NOBODY)  # shard folders and files of another user
    rest = dict(list(blobs.items())[2:])
    _plant(ours, rest, None, NOBODY)  # a shard folder of ours (as root makes it), another user's file
    with caplog.at_level("WARNING", logger="kdn"):
        cache = KDN(KDNConfig(chunk_size=CHUNK, node_dir=str(ours)))
    assert stat.S_IMODE(os.stat(ours).st_mode) == 0o700 and any("narrowed" in r.getMessage() for r in caplog.records)
    assert cache.lookup(model, victim) == 0
    kv, hit = cache.retrieve(model, victim)
    assert hit == 0 and kv is None
    out = cache.generate(model, victim, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, model.generate(victim, max_new_tokens=4, do_sample=False))
    assert all((ours / k.hex()[:2] / f"{k.hex()}.kdnb").read_bytes() == b for k, b in blobs.items())  # not ours: kept
    fresh = KDN(KDNConfig(chunk_size=CHUNK, node_dir=str(ours)))  # a new process: still none of the planted KV
    assert fresh.lookup(model, victim) == 0


def test_keyed_mode_refuses_files_written_without_the_secret(tiny_llama, tmp_path):
    ids = random_ids(tiny_llama, 3 * CHUNK + 1, seed=12)
    plain = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path)))
    plain.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    plain.flush()
    keyed = KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path), secret="correct horse battery")
    assert "correct horse" not in repr(keyed)
    reader = KDN(keyed)
    assert reader.retrieve(tiny_llama, ids)[1] == 0  # keys derive from the secret: the plain files are not even seen
    assert reader.stats()["disk"]["corrupt"] == 0
    reader.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    reader.flush()
    again = KDN(keyed)
    kv, hit = again.retrieve(tiny_llama, ids, limit=ids.shape[1] - 1)
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=kv).logits[0, -1]
    assert hit == 3 * CHUNK and torch.allclose(logits, full_prefill(tiny_llama, ids)[0], atol=1e-5, rtol=0)
    wrong = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path), secret="another secret!"))
    assert wrong.retrieve(tiny_llama, ids)[1] == 0


def test_keyed_mode_on_redis(tiny_llama, redis_server):
    ids = random_ids(tiny_llama, 2 * CHUNK + 1, seed=13)
    RemoteTier(redis_server.url).clear()
    keyed = KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url, secret="s3cret-s3cret")
    writer = KDN(KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url))  # no secret
    writer.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    writer.flush()
    reader = KDN(keyed)
    assert reader.retrieve(tiny_llama, ids)[1] == 0
    # a value without the tag under a keyed name (its writer learned the name): a corrupt miss
    plain_blob = writer.remote.get_many([writer.chunk_keys(tiny_llama, ids)[0]])[0]
    reader.remote.transport.put([(reader.remote.redis_key(reader.chunk_keys(tiny_llama, ids)[0]), plain_blob)], None)
    assert reader.retrieve(tiny_llama, ids)[1] == 0 and reader.stats()["remote"]["corrupt"] == 1
    RemoteTier(redis_server.url).clear()
    keyed_writer = KDN(keyed)
    keyed_writer.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    keyed_writer.flush()
    assert KDN(keyed).retrieve(tiny_llama, ids)[1] == 2 * CHUNK


# -- nothing queued is lost at exit -------------------------------------------------------------------
EXITER = """
import sys
from kdn import KDN, KDNConfig
from kdn.models.tiny import tiny_model
from conftest import full_prefill, random_ids
model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
kdn = KDN(KDNConfig(chunk_size=16, **eval(sys.argv[1])))
for seed in range(150):
    ids = random_ids(model, 257, seed=seed)
    kdn.store(model, ids, full_prefill(model, ids)[1])
# no flush: the interpreter exits with stores still queued
"""


def test_queued_remote_stores_reach_redis_at_exit(redis_server):
    RemoteTier(redis_server.url).clear()
    result = run_python(EXITER, repr({"remote_url": redis_server.url}))
    assert result.returncode == 0, result.stderr
    assert int(redis_server.cli("DBSIZE").stdout) == 2400  # 150 prompts x 16 chunks, none lost


def test_write_back_memory_reaches_the_disk_at_exit(tmp_path):
    result = run_python(EXITER, repr({"disk_dir": str(tmp_path), "write_policy": "write-back"}))
    assert result.returncode == 0, result.stderr
    assert len(list(tmp_path.glob("??/*.kdnb"))) == 2400
