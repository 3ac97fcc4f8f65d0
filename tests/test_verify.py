"""Verified reuse on HF models (``verify_fraction``): honest hits pass, a planted wrong-but-well-formed
chunk (a valid blob holding another prompt's KV under this prompt's key) is found on its first hit,
dropped from every tier, and what was computed over it is never stored; the fidelity rule
(:mod:`kdn.engine.served`) refuses KV computed over lossy KV. References are full prefills."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import forge
from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig, _core
from kdn.engine.served import Served
from kdn.layout import cache_to_kv_list


def _plant(kdn: KDN, model, victim: torch.Tensor, donor: torch.Tensor, chunk_index: int) -> bytes:
    """Replace the stored chunk ``chunk_index`` of ``victim`` by a valid blob of ``donor``'s KV (same
    positions, same model, the victim's key): well-formed, checksummed, and wrong. Returns the key."""
    session = kdn.session(model)
    key = session.prefix_keys(session.tokens(victim[0]))[chunk_index]
    kv = cache_to_kv_list(full_prefill(model, donor)[1])
    chunk = session.chunk_size
    blob = _core.pack_chunk(kv, chunk_index * chunk, chunk, session.fingerprint, key)
    assert forge.plant(kdn.engine, key, blob)
    return key


def _held(kdn: KDN, key: bytes) -> bool:
    return forge.held(kdn.engine, key)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_planted_wrong_chunk_is_found_on_its_first_hit_and_dropped(stories, tmp_path, tier):
    model, _ = stories
    config = {"disk_dir": str(tmp_path / "kv"), "write_policy": "write-through"} if tier == "disk" else {}
    kdn = KDN(KDNConfig(chunk_size=32, verify_fraction=1.0, delivery="whole", **config))
    doc, other = random_ids(model, 100, seed=1), random_ids(model, 100, seed=2)
    question = random_ids(model, 12, seed=3)
    kdn.generate(model, doc, max_new_tokens=1)  # a miss: stored
    kdn.flush()
    bad = _plant(kdn, model, doc, other, chunk_index=1)
    prompt = torch.cat([doc, question], dim=1)
    kdn.generate(model, prompt, max_new_tokens=4)
    integrity = kdn.stats()["integrity"]
    assert integrity["checks"] == 1 and integrity["mismatches"] == 1 and integrity["dropped_chunks"] == 1
    assert not _held(kdn, bad)  # the forged chunk is gone from every tier
    session = kdn.session(model)
    good = session.prefix_keys(session.tokens(doc[0]))[0]
    assert _held(kdn, good)  # the honest chunk before it stays
    # nothing computed over the forged chunk was stored: the next hit stops before it, recomputes,
    # stores the right KV, and an exact reader then gets a full prefill's logits
    assert kdn.lookup(model, prompt) == 32
    kdn.generate(model, prompt, max_new_tokens=1)
    kdn.flush()
    reader = KDN(KDNConfig(chunk_size=32, **config)) if tier == "disk" else kdn
    cache, hit = reader.retrieve(model, prompt, limit=prompt.shape[1] - 1)
    assert hit >= 96  # the whole document (the question's last 15 tokens are under one probe step)
    with torch.inference_mode():
        served = model(prompt[:, hit:], past_key_values=cache).logits[0, -1]
    assert float((served - full_prefill(model, prompt)[0]).abs().max()) < 1e-3
    assert kdn.stats()["integrity"]["mismatches"] == 1  # the recomputed prompt's hits pass


@pytest.mark.slow
def test_honest_hits_pass_verification_on_smollm2(smollm2):
    """0 false mismatches: every hit of several prompts sharing a document is checked and passes."""
    model, tokenizer = smollm2
    kdn = KDN(KDNConfig(verify_fraction=1.0))
    doc = tokenizer(_velmora().read_text()).input_ids[:700]
    for q in (" Who founded the city?", " How long is the ferry?", " What is sold at the market?"):
        ids = torch.tensor([doc + tokenizer(q).input_ids])
        kdn.generate(model, ids, max_new_tokens=2)
    integrity = kdn.stats()["integrity"]
    assert integrity["checks"] == 2 and integrity["mismatches"] == 0


def test_a_planted_chunk_is_found_through_a_later_chunk(stories):
    """The last served tokens see every chunk before them: a forgery in the first chunk is caught by
    recomputing the last 16 tokens of a 4-chunk hit, and localized by the full recompute."""
    model, _ = stories
    kdn = KDN(KDNConfig(chunk_size=32, verify_fraction=1.0))
    doc, other = random_ids(model, 128, seed=4), random_ids(model, 128, seed=5)
    kdn.generate(model, doc, max_new_tokens=1)
    bad = _plant(kdn, model, doc, other, chunk_index=0)
    kdn.generate(model, torch.cat([doc, random_ids(model, 8, seed=6)], dim=1), max_new_tokens=1)
    assert kdn.stats()["integrity"]["mismatches"] == 1
    assert not _held(kdn, bad) and kdn.lookup(model, doc) == 0


def test_verification_off_by_default_and_sampled(stories):
    model, _ = stories
    doc = random_ids(model, 80, seed=7)
    off = KDN(KDNConfig(chunk_size=32))
    some = KDN(KDNConfig(chunk_size=32, verify_fraction=0.5))
    for kdn in (off, some):
        kdn.generate(model, doc, max_new_tokens=1)
        for i in range(20):
            kdn.generate(model, torch.cat([doc, random_ids(model, 4, seed=10 + i)], dim=1), max_new_tokens=1)
    assert off.stats()["integrity"]["checks"] == 0
    assert 2 <= some.stats()["integrity"]["checks"] <= 18 and some.stats()["integrity"]["mismatches"] == 0


def test_lossy_hits_are_not_judged_and_never_stored_as_exact(stories, tmp_path):
    """A lossy memory tier over an exact disk tier: a prompt partly served from the lossy tier is not
    stored back under exact keys, so an exact reader of the disk folder gets a full prefill's KV."""
    model, _ = stories
    disk = str(tmp_path / "kv")
    writer = KDN(KDNConfig(chunk_size=32, memory_codec="int4", disk_dir=disk, verify_fraction=1.0,
                           delivery="whole", write_policy="memory-only"))
    doc = random_ids(model, 96, seed=8)
    writer.generate(model, doc, max_new_tokens=1)  # miss: stored int4 in memory (memory-only: not on disk)
    prompt = torch.cat([doc, random_ids(model, 40, seed=9)], dim=1)
    writer.generate(model, prompt, max_new_tokens=1)  # partly served from int4: nothing stored as exact
    writer.flush()
    assert writer.stats()["integrity"]["skipped_lossy"] == 1 and writer.stats()["integrity"]["refused_stores"] >= 1
    reader = KDN(KDNConfig(chunk_size=32, disk_dir=disk))
    assert reader.lookup(model, prompt) == 0


def test_the_fidelity_rule():
    assert Served().unstorable() is None
    assert "lossy" in Served(tokens=10, lossy=True).unstorable()
    assert "failed" in Served(failed=True).unstorable()
    assert "verification" in Served(suspect=True).unstorable()
    assert Served(tokens=90, checked=8).covers(100, 16) and not Served(tokens=80).covers(100, 16)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "often", True])
def test_verify_fraction_outside_zero_one_is_refused(value):
    with pytest.raises(InvalidInputError, match="verify_fraction"):
        KDNConfig(verify_fraction=value)


def test_the_chunk_writer_refuses_what_the_rule_refuses(stories):
    model, _ = stories
    kdn = KDN(KDNConfig(chunk_size=32))
    ids = random_ids(model, 64, seed=11)
    kv = [t.cpu() for t in cache_to_kv_list(full_prefill(model, ids)[1])]
    session = kdn.session(model)
    tokens = session.tokens(ids[0])
    assert kdn.engine.save(session, tokens, kv, Served(tokens=32, failed=True)) == 0
    assert kdn.engine.save(session, tokens, kv, Served(tokens=32, lossy=True)) == 0
    assert kdn.lookup(model, ids) == 0 and kdn.stats()["integrity"]["refused_stores"] == 2
    assert kdn.engine.save(session, tokens, kv, Served()) == 64
    assert np.array_equal(tokens, session.tokens(ids))


def _velmora():
    from pathlib import Path

    import kdn

    return Path(kdn.__file__).parent / "data" / "velmora.txt"


def _stored_store(model, config: dict) -> tuple[KDN, list]:
    """Two prompts sharing a document, generated (so stored) through ``config``'s tiers."""
    kdn = KDN(KDNConfig(chunk_size=32, **config))
    doc = random_ids(model, 70, seed=20)  # the prompts part 6 tokens into their third chunk
    prompts = [torch.cat([doc, random_ids(model, 50, seed=21 + i)], dim=1) for i in range(2)]
    for p in prompts:
        kdn.generate(model, p, max_new_tokens=1)
    kdn.flush()
    return kdn, prompts


def test_kdn_verify_finds_and_drops_a_planted_chunk_in_a_disk_folder(stories, tmp_path, capsys):
    from kdn.cli import main

    model, _ = stories
    folder = str(tmp_path / "kv")
    kdn, prompts = _stored_store(model, {"disk_dir": folder})
    assert main(["verify", folder, "--model", "stories260k", "--chunk-size", "32"]) == 0
    assert "2 stored prompts rebuilt" in capsys.readouterr().out
    bad = _plant(kdn, model, prompts[1], random_ids(model, 120, seed=30), chunk_index=2)
    kdn.flush()
    assert main(["verify", folder, "--model", "stories260k", "--chunk-size", "32", "--drop"]) == 1
    out = capsys.readouterr().out
    assert f"mismatch {bad.hex()} (dropped)" in out and "1 differ" in out
    assert main(["verify", folder, "--model", "stories260k", "--chunk-size", "32"]) == 0
    reader = KDN(KDNConfig(chunk_size=32, disk_dir=folder))
    assert reader.lookup(model, prompts[1]) == 64 and reader.lookup(model, prompts[0]) == 119


def test_kdn_verify_reads_a_redis_store(stories, redis_server, capsys):
    from kdn.cli import main

    model, _ = stories
    redis_server.cli("FLUSHALL")
    _stored_store(model, {"remote_url": redis_server.url})
    assert main(["verify", redis_server.url, "--model", "stories260k", "--chunk-size", "32", "--sample", "1"]) == 0
    assert "1 recomputed" in capsys.readouterr().out


@pytest.mark.parametrize("store", ["/nonexistent/kv", "redis://127.0.0.1:1/0", "ftp://x"])
def test_kdn_verify_on_a_store_it_cannot_read_is_one_line(store, capsys):
    from kdn.cli import main

    assert main(["verify", store, "--model", "stories260k"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kdn verify: ") and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("forgery", ["edited_tokens", "another_chunk"])
def test_a_forged_pointer_is_never_followed(stories, forgery):
    """A well-formed pointer (valid checksum, right model, filed under the right probe) that lies: its
    tokens edited to claim more than the chunk shares with the reader, or naming another stored chunk.
    The chunk's key is recomputed from the pointer's parent and tokens, so the lie is dropped and the
    hit stops before it; what is served equals a full prefill."""
    model, _ = stories
    kdn = KDN(KDNConfig(chunk_size=32, probe_step=16))
    stored = random_ids(model, 96, seed=40)
    kdn.generate(model, stored, max_new_tokens=1)
    session = kdn.session(model)
    keys = session.prefix_keys(session.tokens(stored[0]))
    # a reader that shares the first chunk and 20 tokens of the second, then differs
    reader = torch.cat([stored[:, :52], random_ids(model, 30, seed=41)], dim=1)
    tokens = session.tokens(reader[0])
    probe = session.probe_keys(keys[0], tokens[32:64])[0]  # its first probe: the 16 shared tokens
    assert forge.held(kdn.engine, probe) and kdn.lookup(model, reader) == 52
    chunk_tokens = session.tokens(stored[0])[32:64].copy()
    if forgery == "edited_tokens":  # claims the reader's own tokens: 32 shared instead of 20
        chunk_tokens[:] = tokens[32:64]
        target = keys[1]
    else:  # the true tokens, but another stored chunk's key
        target = keys[2]
    forged = _core.pack_pointer(session.fingerprint, probe, target, 32, chunk_tokens)
    assert forge.plant(kdn.engine, probe, forged)
    assert kdn.lookup(model, reader) == 32  # the pointer is dropped: whole chunks only
    assert not forge.held(kdn.engine, probe)
    cache, hit = kdn.retrieve(model, reader, limit=reader.shape[1] - 1)
    assert hit == 32
    with torch.inference_mode():
        served = model(reader[:, hit:], past_key_values=cache).logits[0, -1]
    assert float((served - full_prefill(model, reader)[0]).abs().max()) < 1e-3


def test_kdn_verify_that_checked_nothing_says_so_and_fails(stories, tmp_path, capsys):
    """A store written with ``probe_step == chunk_size`` has no pointers, so no prompt can be rebuilt:
    ``kdn verify`` says it checked nothing and exits 1 (it exited 0, as if the store were sound)."""
    from kdn.cli import main

    model, _ = stories
    folder = str(tmp_path / "kv")
    _stored_store(model, {"disk_dir": folder, "probe_step": 32})
    assert main(["verify", folder, "--model", "stories260k", "--chunk-size", "32"]) == 1
    err = capsys.readouterr().err
    assert "checked nothing" in err and "chunk_size == probe_step" in err


def test_no_audit_and_no_smaller_capacity_deletes_a_keyed_tenants_files(stories, tmp_path, capsys, monkeypatch):
    """Issue 62: ``kdn verify`` without the tenant's secret reads its files as another key's (a miss,
    checked nothing) and deletes none; with ``KDN_SECRET`` it verifies them (and deletes none); a
    process opening the folder with a 4 KiB capacity (a fraction of what it holds), and
    ``verify --disk-bytes 4KiB``, delete nothing either."""
    from kdn.cli import main

    model, _ = stories
    folder = tmp_path / "kv"
    _stored_store(model, {"disk_dir": str(folder), "secret": "the tenant's secret"})

    def files():
        return sorted(p.name for p in folder.glob("??/*.kdnb"))

    before = files()
    assert len(before) > 4 and sum(p.stat().st_size for p in folder.glob("??/*.kdnb")) > 16 * 4096
    monkeypatch.delenv("KDN_SECRET", raising=False)
    assert main(["verify", str(folder), "--model", "stories260k", "--chunk-size", "32"]) == 1
    assert "checked nothing" in capsys.readouterr().err and files() == before
    KDN(KDNConfig(chunk_size=32, disk_dir=str(folder), disk_bytes="4KiB"))
    assert files() == before
    monkeypatch.setenv("KDN_SECRET", "the tenant's secret")
    for extra in ([], ["--disk-bytes", "4KiB"]):
        assert main(["verify", str(folder), "--model", "stories260k", "--chunk-size", "32", *extra]) == 0
        assert "0 differ" in capsys.readouterr().out and files() == before


def test_kdn_verify_skips_a_chain_of_token_ids_outside_the_vocabulary(stories, tmp_path, capsys):
    """Issue 62: a pointer planted with token ids no model has (a well-formed chain otherwise) is
    reported and not recomputed (it was a 71-line traceback); the honest prompts are verified."""
    import numpy as np

    from kdn.cli import main
    from kdn.engine.session import ROOT

    model, _ = stories
    folder = str(tmp_path / "kv")
    kdn, _ = _stored_store(model, {"disk_dir": folder})
    session = kdn.session(model)
    oov = np.arange(model.config.vocab_size + 10, model.config.vocab_size + 42, dtype=np.uint32)
    probe = session.probe_keys(ROOT, oov)[0]
    assert forge.plant(kdn.engine, probe, _core.pack_pointer(session.fingerprint, probe,
                                                          session.chunk_key(ROOT, oov), 0, oov))
    kdn.flush()
    assert main(["verify", folder, "--model", "stories260k", "--chunk-size", "32"]) == 0
    captured = capsys.readouterr()
    assert "1 prompts with token ids outside the model's vocabulary" in captured.out and "Traceback" not in captured.err
