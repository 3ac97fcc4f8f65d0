"""kdn for operators (issue 85, first part): ``kdn stats``, ``kdn ls`` and ``kdn evict`` over a store
another process wrote (a disk folder, a Redis server), compared with what the store holds: the
listing is exactly the stored prompts, an evicted document is a miss in a new engine while the
others (and a prefix they share, and another tenant's copy) still hit, and what stays reads back
as a full prefill's KV."""

import json
import os
import time

import pytest
import torch

from conftest import full_prefill
from kdn import KDN, KDNConfig
from kdn.cli import main

CHUNK = 32


def _cli(capsys, *args) -> tuple[int, dict]:
    code = main([*args, "--chunk-size", str(CHUNK), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _prompts(model):
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, 500, (3 * CHUNK,), generator=g).tolist()
    other = torch.randint(3, 500, (2 * CHUNK,), generator=g).tolist()
    questions = [torch.randint(3, 500, (CHUNK,), generator=g).tolist() for _ in range(2)]
    return {"doc+q1": doc + questions[0], "doc+q2": doc + questions[1], "other": other}


@pytest.fixture(params=["disk", "redis"])
def store(request, tmp_path):
    if request.param == "disk":
        return str(tmp_path / "kv"), {"disk_dir": str(tmp_path / "kv")}
    server = request.getfixturevalue("redis_server")
    KDN(KDNConfig(remote_url=server.url)).clear()
    return server.url, {"remote_url": server.url}


def test_ls_lists_what_another_process_stored_and_evict_removes_one_document(stories, store, capsys, monkeypatch):
    model, _ = stories
    where, settings = store
    prompts = _prompts(model)
    writer = KDN(KDNConfig(chunk_size=CHUNK, **settings))
    for ids in prompts.values():
        ids = torch.tensor([ids])
        writer.store(model, ids, full_prefill(model, ids)[1])
    tenant = KDN(KDNConfig(chunk_size=CHUNK, namespace="tenant-b", **settings))  # another tenant's copy
    tenant.store(model, torch.tensor([prompts["other"]]), full_prefill(model, torch.tensor([prompts["other"]]))[1])
    writer.flush(), tenant.flush()
    monkeypatch.delenv("KDN_NAMESPACE", raising=False)

    code, stats = _cli(capsys, "stats", where)
    tier = "disk" if "disk_dir" in settings else "remote"
    assert code == 0 and stats[tier]["entries"] == len(list((writer.disk or writer.remote).keys()))
    code, listed = _cli(capsys, "ls", where, "--model", "stories260k")
    assert code == 0
    assert sorted(p["token_ids"] for p in listed["prompts"]) == sorted(prompts.values())  # not tenant-b's
    assert all(p["served"] == p["tokens"] and tier in p["tiers"] for p in listed["prompts"])

    code, out = _cli(capsys, "evict", where, "--model", "stories260k", "--tokens",
                     ",".join(map(str, prompts["doc+q1"])))
    assert code == 0 and out == {"prompts": 1, "chunks_removed": 1}  # q1's chunk: the document stays, q2's
    code, out = _cli(capsys, "evict", where, "--model", "stories260k", "--tokens",
                     ",".join(map(str, prompts["other"])))
    assert code == 0 and out["chunks_removed"] == 2
    reader = KDN(KDNConfig(chunk_size=CHUNK, **settings))  # a new engine
    assert reader.lookup(model, prompts["other"], limit=2 * CHUNK) == 0
    assert reader.lookup(model, prompts["doc+q1"], limit=4 * CHUNK) == 3 * CHUNK  # the shared document only
    ids = torch.tensor([prompts["doc+q2"]])
    assert reader.lookup(model, ids[0], limit=4 * CHUNK) == 4 * CHUNK
    kv, hit = reader.retrieve(model, ids)
    with torch.inference_mode():
        logits = model(ids[:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, full_prefill(model, ids)[0], rtol=1e-4, atol=1e-4)  # exact, as stored
    other_tenant = KDN(KDNConfig(chunk_size=CHUNK, namespace="tenant-b", **settings))
    assert other_tenant.lookup(model, prompts["other"], limit=2 * CHUNK) == 2 * CHUNK  # untouched
    code, listed = _cli(capsys, "ls", where, "--model", "stories260k")
    assert [p["token_ids"] for p in listed["prompts"]] == [prompts["doc+q2"]]  # the document: q2's prefix now


def test_evict_older_than_removes_the_prompts_not_written_since(stories, tmp_path, capsys):
    model, _ = stories
    prompts = _prompts(model)
    writer = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv")))
    for ids in prompts.values():
        ids = torch.tensor([ids])
        writer.store(model, ids, full_prefill(model, ids)[1])
    writer.flush()
    old = time.time() - 3600
    for key in writer.chunk_keys(model, prompts["other"]):
        os.utime(writer.disk.store.path_of(key), (old, old))
    code, out = _cli(capsys, "evict", str(tmp_path / "kv"), "--model", "stories260k", "--older-than", "600")
    assert code == 0 and out == {"prompts": 1, "chunks_removed": 2}
    reader = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv")))
    assert reader.lookup(model, prompts["other"], limit=2 * CHUNK) == 0
    assert reader.lookup(model, prompts["doc+q1"], limit=4 * CHUNK) == 4 * CHUNK
    code, out = _cli(capsys, "evict", str(tmp_path / "kv"), "--model", "stories260k", "--older-than", "600")
    assert code == 1 and out["chunks_removed"] == 0  # nothing that old is left
    assert main(["ls", str(tmp_path / "nowhere"), "--model", "stories260k"]) == 2


def test_evict_all_removes_one_tenants_prompts_and_no_one_elses(stories, tmp_path, capsys, monkeypatch):
    """`kdn evict --all` under a tenant's KDN_NAMESPACE: every prompt of that tenant is a miss in a new
    engine; the same text stored by the default tenant still hits and reads back as a full prefill."""
    model, _ = stories
    prompts = _prompts(model)
    settings = {"disk_dir": str(tmp_path / "kv")}
    for namespace in (None, "tenant-b"):
        writer = KDN(KDNConfig(chunk_size=CHUNK, namespace=namespace, **settings))
        for ids in prompts.values():
            writer.store(model, torch.tensor([ids]), full_prefill(model, torch.tensor([ids]))[1])
        writer.flush()
    monkeypatch.setenv("KDN_NAMESPACE", "tenant-b")
    code, out = _cli(capsys, "evict", settings["disk_dir"], "--model", "stories260k", "--all")
    assert code == 0 and out["prompts"] == 3 and out["chunks_removed"] == 3 + 1 + 1 + 2
    monkeypatch.delenv("KDN_NAMESPACE")
    tenant = KDN(KDNConfig(chunk_size=CHUNK, namespace="tenant-b", **settings))
    owner = KDN(KDNConfig(chunk_size=CHUNK, **settings))
    for ids in prompts.values():
        assert tenant.lookup(model, ids, limit=len(ids)) == 0
        assert owner.lookup(model, ids, limit=len(ids)) == len(ids) // CHUNK * CHUNK
    ids = torch.tensor([prompts["doc+q1"]])
    kv, hit = owner.retrieve(model, ids)
    reference = full_prefill(model, ids)[1]  # what was stored: the prompt's full prefill
    assert hit == 4 * CHUNK - 1 and all(torch.equal(a.keys, b.keys[:, :, :hit]) and
                                        torch.equal(a.values, b.values[:, :, :hit])
                                        for a, b in zip(kv.layers, reference.layers))


def test_stats_with_a_model_says_what_this_tenant_holds(stories, tmp_path, capsys, monkeypatch):
    """`kdn stats --model`: the tenant's prompts, their distinct chunks (a shared document once) and
    their bytes, equal to the store's own blobs; another tenant's copy counted under its name only."""
    model, _ = stories
    prompts = _prompts(model)
    settings = {"disk_dir": str(tmp_path / "kv")}
    writers = {}
    for namespace, chosen in ((None, list(prompts)), ("tenant-b", ["other"])):
        writers[namespace] = KDN(KDNConfig(chunk_size=CHUNK, namespace=namespace, **settings))
        for name in chosen:
            ids = torch.tensor([prompts[name]])
            writers[namespace].store(model, ids, full_prefill(model, ids)[1])
        writers[namespace].flush()
    monkeypatch.delenv("KDN_NAMESPACE", raising=False)
    code, out = _cli(capsys, "stats", settings["disk_dir"], "--model", "stories260k")
    keys = {k for name in prompts for k in writers[None].chunk_keys(model, prompts[name])}
    assert code == 0 and out["tenant"]["prompts"] == 3 and out["tenant"]["chunks"] == len(keys) == 7
    assert out["tenant"]["bytes"] == sum(len(writers[None].disk.get(k)) for k in keys)
    monkeypatch.setenv("KDN_NAMESPACE", "tenant-b")
    code, out = _cli(capsys, "stats", settings["disk_dir"], "--model", "stories260k")
    assert out["tenant"] == {"namespace": "tenant-b", "prompts": 1, "chunks": 2, "bytes": out["tenant"]["bytes"]}
    assert out["tenant"]["bytes"] > 0 and out["disk"]["entries"] > 9  # the folder holds both tenants' chunks
