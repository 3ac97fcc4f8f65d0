"""Never another model's KV, never lossier KV than a reader accepts (issue: reliability and trust)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import kdn
from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.keys import checkpoint_fingerprint, model_fingerprint
from kdn.models.tiny import tiny_model
from kdn.storage.remote import RemoteTier

CHUNK = 16


@pytest.fixture()
def model(tiny_llama):
    """A private copy of tiny_llama that a test may change in place."""
    return copy.deepcopy(tiny_llama)


def last_logits_via(cache: KDN, model, ids):
    kv, hit = cache.retrieve(model, ids, limit=ids.shape[1] - 1)
    with torch.inference_mode():
        out = model(ids[:, hit:], past_key_values=kv) if hit else model(ids)
    return out.logits[0, -1], hit


def skipped_by_a_sample(numel: int, lo: int, hi: int) -> int:
    """A flat index in [lo, hi) that the first fingerprint's 4096 evenly spaced samples never read."""
    sampled = {i * (numel - 1) // 4095 for i in range(4096)}
    return next(i for i in range(lo, hi) if i not in sampled)


@pytest.mark.parametrize("where", ["embedding row", "one mlp value"])
def test_a_fine_tune_of_one_value_is_never_served_the_base_models_kv(model, where):
    cache = KDN(KDNConfig(chunk_size=CHUNK))
    ids = random_ids(model, 4 * CHUNK + 3, seed=1)
    cache.store(model, ids, full_prefill(model, ids)[1])
    base = model_fingerprint(model)
    with torch.no_grad():  # a change the old 4096-value sample did not see
        w = model.model.embed_tokens.weight if where == "embedding row" else model.model.layers[0].mlp.up_proj.weight
        row = int(ids[0, 5]) if where == "embedding row" else w.shape[0] // 2
        w.view(-1)[skipped_by_a_sample(w.numel(), row * w.shape[1], (row + 1) * w.shape[1])] += 3.0
    assert model_fingerprint(model) != base
    assert cache.lookup(model, ids) == 0
    ref = full_prefill(model, ids)[0]
    got, hit = last_logits_via(cache, model, ids)
    assert hit == 0 and torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_a_model_cast_in_place_misses_its_old_kv_and_runs(model):
    cache = KDN(KDNConfig(chunk_size=CHUNK))
    ids = random_ids(model, 3 * CHUNK + 1, seed=2)
    expected32 = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(cache.generate(model, ids, max_new_tokens=4, do_sample=False), expected32)
    model.to(torch.bfloat16)  # the same object, now bf16: its fp32 KV must not be served
    assert cache.lookup(model, ids) == 0
    expected16 = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(cache.generate(model, ids, max_new_tokens=4, do_sample=False), expected16)
    assert cache.generate(model, ids, max_new_tokens=4, do_sample=False).shape == expected16.shape


def test_fingerprint_is_stable_for_the_same_weights(tiny_llama, model):
    assert model_fingerprint(model) == model_fingerprint(tiny_llama)  # a deep copy: same bytes
    model.load_state_dict(tiny_llama.state_dict())
    assert model_fingerprint(model) == model_fingerprint(tiny_llama)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny", "stories260k"])
def test_a_checkpoints_files_give_the_loaded_models_fingerprint(tmp_path, name, dtype):
    """A serving engine's scheduler has no weights: it fingerprints the checkpoint's files, and gets
    what an HF process that loaded them gets (stories260K ties its output embedding to its input),
    and what the saved model itself had before saving (save_pretrained fills in its config)."""
    model = tiny_model() if name == "tiny" else kdn.models.load("stories260k")[0]
    before = model_fingerprint(model.to(dtype))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert checkpoint_fingerprint(tmp_path, dtype) == model_fingerprint(loaded) == before
    assert checkpoint_fingerprint(tmp_path, dtype) != checkpoint_fingerprint(tmp_path, torch.float16)


@pytest.mark.slow
def test_smollm2s_converted_checkpoint_gives_the_loaded_models_fingerprint(smollm2):
    from kdn.models import smollm2 as smollm2_files

    folder = smollm2_files.converted_dir(smollm2_files.gguf_path())
    assert checkpoint_fingerprint(folder, torch.float32) == model_fingerprint(smollm2[0])


def test_a_folder_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidInputError, match="not an HF checkpoint folder"):
        checkpoint_fingerprint(tmp_path, torch.float32)


def test_meta_weights_are_a_clear_error():
    from kdn.models.tiny import tiny_model

    with torch.device("meta"):
        meta = tiny_model("llama", layers=1, heads=2, kv_heads=1, head_dim=8)
    with pytest.raises(InvalidInputError, match="meta device"):
        model_fingerprint(meta)


def writer_and_reader(tmp_path, writer_codec="int2", **reader):
    """Two KDNs sharing one disk folder: an int2 writer, and a reader configured by ``reader``."""
    shared = {"chunk_size": CHUNK, "disk_dir": str(tmp_path / "kv")}
    writer = KDN(KDNConfig(**shared, memory_codec=writer_codec, disk_codec=writer_codec))
    return writer, KDN(KDNConfig(**shared, **reader))


def test_an_exact_reader_never_gets_a_lossy_writers_chunks(model, tmp_path):
    ids = random_ids(model, 4 * CHUNK + 3, seed=3)
    writer, reader = writer_and_reader(tmp_path)
    writer.store(model, ids, full_prefill(model, ids)[1])
    writer.flush()
    assert writer.lookup(model, ids) == 4 * CHUNK  # the writer reads its own int2 chunks
    assert reader.lookup(model, ids) == 0  # exact only (the default): the int2 files are not its
    ref = full_prefill(model, ids)[0]
    got, hit = last_logits_via(reader, model, ids)
    assert hit == 0 and torch.allclose(got, ref, atol=1e-5, rtol=0)
    # its own store puts exact chunks beside the lossy ones; both processes keep what they accept
    reader.store(model, ids, full_prefill(model, ids)[1])
    reader.flush()
    fresh = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv")))
    got, hit = last_logits_via(fresh, model, ids)
    assert hit == 4 * CHUNK and torch.allclose(got, ref, atol=1e-5, rtol=0)  # exact, from disk
    assert len(list((tmp_path / "kv").glob("??/*.kdnb"))) == 8  # 4 int2 + 4 exact files


def test_a_reader_that_accepts_a_lossy_codec_is_served_it(model, tmp_path):
    ids = random_ids(model, 4 * CHUNK + 3, seed=4)
    writer, reader = writer_and_reader(tmp_path, accept_codecs="int2")
    writer.store(model, ids, full_prefill(model, ids)[1])
    writer.flush()
    assert reader.lookup(model, ids) == 4 * CHUNK
    got, hit = last_logits_via(reader, model, ids)
    ref = full_prefill(model, ids)[0]
    lossy_ref, _ = last_logits_via(writer, model, ids)
    assert hit == 4 * CHUNK and torch.allclose(got, lossy_ref, atol=1e-5, rtol=0)
    assert not torch.allclose(got, ref, atol=1e-3, rtol=0)  # int2: really the lossy chunks
    # an int8-accepting reader does not take int2 either
    _, int8_reader = writer_and_reader(tmp_path, accept_codecs=["int8"])
    assert int8_reader.lookup(model, ids) == 0


def test_an_exact_reader_misses_lossy_chunks_in_a_shared_redis(model, redis_server):
    ids = random_ids(model, 3 * CHUNK + 2, seed=6)
    url = redis_server.url
    RemoteTier(url).clear()  # the session's server: start from an empty store
    writer = KDN(KDNConfig(chunk_size=CHUNK, remote_url=url, remote_codec="int4"))
    writer.store(model, ids, full_prefill(model, ids)[1])
    writer.flush()
    writer.memory.clear()  # what is left is in redis
    assert writer.lookup(model, ids) == 3 * CHUNK  # from redis, its int4 chunks
    reader = KDN(KDNConfig(chunk_size=CHUNK, remote_url=url))
    assert reader.lookup(model, ids) == 0
    reader.store(model, ids, full_prefill(model, ids)[1])
    reader.flush()
    other = KDN(KDNConfig(chunk_size=CHUNK, remote_url=url))
    got, hit = last_logits_via(other, model, ids)
    assert hit == 3 * CHUNK and torch.allclose(got, full_prefill(model, ids)[0], atol=1e-5, rtol=0)


def test_accept_codecs_is_validated():
    with pytest.raises(InvalidInputError, match="accept_codecs"):
        KDNConfig(accept_codecs=["int3"])
    assert KDNConfig(accept_codecs="int8, cachegen:level=3").accept_codecs == ("int8", "cachegen:level=3")
    assert KDNConfig(disk_codec="int4", accept_codecs=["lossless"]).lossy_codecs() == ("int4",)
