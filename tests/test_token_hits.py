"""Token-granular hits: a prompt is served every token it shares with a stored one, not only whole
chunks, in this process, in another process (disk tier) and through a shared Redis (remote tier)."""

import logging
import subprocess

import pytest
import torch

import forge
from conftest import full_prefill, random_ids
from disk_helpers import python_process
from kdn import KDN, KDNConfig, _core
from kdn.engine.session import ROOT

CHUNK = 32  # probes every 16 tokens (KDNConfig.probe_step): one pointer per chunk


def prompts(model, shared: int, length: int = 100):
    """Two prompts of ``length`` tokens that agree on exactly their first ``shared`` tokens."""
    a = random_ids(model, length, seed=shared)
    b = a.clone()
    b[0, shared:] = (a[0, shared:] + 1 - 3) % (model.config.vocab_size - 3) + 3  # differs at every later token
    return a, b


def expected_hit(shared: int) -> int:
    """Whole chunks, then the rest of the shared run when a probe (16 tokens) can find it."""
    return shared if shared % CHUNK >= 16 else shared - shared % CHUNK


def check_served(model, kdn, b, hit_wanted):
    assert kdn.lookup(model, b) == hit_wanted
    cache, hit = kdn.retrieve(model, b, limit=b.shape[1] - 1)
    assert hit == hit_wanted
    reference, reference_cache = full_prefill(model, b)
    if hit:
        for layer, ref in zip(cache.layers, reference_cache.layers):  # the KV of the shared tokens, exactly
            torch.testing.assert_close(layer.keys, ref.keys[:, :, :hit], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.values, ref.values[:, :, :hit], rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        logits = model(b[:, hit:], past_key_values=cache).logits[0, -1]
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


# 20: inside the first chunk; 50: a chunk and 18 tokens; 40: 8 tokens past a chunk (below a probe);
# 90: two chunks and 26 tokens of the third
@pytest.mark.parametrize("shared", [20, 50, 40, 90])
def test_a_prompt_is_served_every_token_it_shares(tiny_llama, shared):
    a, b = prompts(tiny_llama, shared)
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.store(tiny_llama, a, full_prefill(tiny_llama, a)[1])
    check_served(tiny_llama, kdn, b, expected_hit(shared))


def test_a_stored_prompt_ending_inside_a_chunk_is_served_whole(tiny_llama):
    a = random_ids(tiny_llama, 90, seed=5)  # 2 chunks and a 26-token tail
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    assert kdn.store(tiny_llama, a, full_prefill(tiny_llama, a)[1]) == 90
    longer = torch.cat([a, random_ids(tiny_llama, 10, seed=6)], dim=1)
    check_served(tiny_llama, kdn, longer, 90)
    # a tail shorter than a probe is not stored: no pointer could find it
    kdn.clear()
    assert kdn.store(tiny_llama, a[:, :70], full_prefill(tiny_llama, a[:, :70])[1]) == 64


def test_pointers_are_bounded_and_off_with_probe_step_zero(tiny_llama):
    a, b = prompts(tiny_llama, 50)
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.store(tiny_llama, a, full_prefill(tiny_llama, a)[1])
    assert kdn.stats()["memory"]["entries"] == 3 + 3  # 3 chunks, a pointer each; the 4-token tail is not stored
    off = KDN(KDNConfig(chunk_size=CHUNK, probe_step=0))
    off.store(tiny_llama, a, full_prefill(tiny_llama, a)[1])
    assert off.stats()["memory"]["entries"] == 3  # whole chunks only, no pointers
    check_served(tiny_llama, off, b, 32)


def test_a_forged_pointer_is_never_followed(tiny_llama, caplog):
    """A pointer that claims its chunk holds the reader's tokens (so it would serve another prompt's
    KV) is caught: the chunk key is recomputed from the pointer's tokens and does not match."""
    a, b = prompts(tiny_llama, 40)  # a and b share one chunk and 8 tokens
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.store(tiny_llama, a, full_prefill(tiny_llama, a)[1])
    session = kdn.session(tiny_llama)
    ta, tb = session.tokens(a), session.tokens(b)
    keys = session.prefix_keys(ta)
    probe = session.probe_keys(keys[0], tb[32:48])[0]  # where a reader of b looks for chunk 1
    forged = _core.pack_pointer(session.fingerprint, probe, keys[1], 32, tb[32:64])  # a's chunk, b's tokens
    forge.plant(kdn.engine, probe, forged)
    with caplog.at_level(logging.WARNING, logger="kdn"):
        check_served(tiny_llama, kdn, b, 32)
    assert sum("unusable stored pointer" in r.getMessage() for r in caplog.records) == 1
    assert not forge.held(kdn.engine, probe)  # dropped
    assert session.probe_keys(ROOT, ta[:16]) != session.probe_keys(keys[0], ta[32:48])  # probes depend on the parent


def test_a_pointer_whose_chunk_is_gone_is_not_promised(tiny_llama, caplog):
    """A pointer outlives its chunk when the chunk's write is dropped (a full disk queue) or the chunk is
    evicted alone: a lookup then stops before it (a shorter hit, the pointer dropped) instead of
    promising tokens a load cannot serve (vLLM would have to recompute them)."""
    a, b = prompts(tiny_llama, 50)  # a chunk and 18 tokens shared: the 18 come through a pointer
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.store(tiny_llama, a, full_prefill(tiny_llama, a)[1])
    session = kdn.session(tiny_llama)
    keys = session.prefix_keys(session.tokens(a))
    assert kdn.lookup(tiny_llama, b) == 50
    forge.tiers(kdn.engine).remove(keys[1])  # the pointed-to chunk alone
    with caplog.at_level(logging.WARNING, logger="kdn"):
        check_served(tiny_llama, kdn, b, 32)
    assert sum("the chunk it names is not stored" in r.getMessage() for r in caplog.records) == 1


STORER = """
import sys
import torch
from kdn import KDN, KDNConfig
from kdn.models.tiny import tiny_model
model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
where, ids = sys.argv[1], torch.tensor([[int(t) for t in sys.argv[2].split(",")]])
kdn = KDN(KDNConfig(chunk_size=32, **({"remote_url": where} if "://" in where else {"disk_dir": where})))
kdn.generate(model, ids, max_new_tokens=1, do_sample=False)
kdn.flush()
"""


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_another_process_or_machine_serves_the_shared_tokens(tiny_llama, tmp_path, request, tier):
    a, b = prompts(tiny_llama, 50)
    where = str(tmp_path / "kdn") if tier == "disk" else request.getfixturevalue("redis_server").url
    if tier == "remote":
        KDN(KDNConfig(remote_url=where)).remote.clear()
    proc = python_process(STORER, where, ",".join(map(str, a[0].tolist())), stdout=subprocess.PIPE, text=True)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    reader = KDN(KDNConfig(chunk_size=CHUNK, **({"disk_dir": where} if tier == "disk" else {"remote_url": where})))
    check_served(tiny_llama, reader, b, 50)
    if reader.last_retrieve["stream"] is not None:
        reader.last_retrieve["stream"].wait_all()  # a layer-wise stream counts its hits when it ends
    assert reader.stats()[tier]["hits"] >= 2  # chunk 0, the pointer, chunk 1 came from the other process
