"""What changes KV is in its key (issue 62): an HF PEFT model's active adapter set (and
``disable_adapter()``), a LoRA adapter's files (what a vLLM ``LoRARequest`` names) and a request's
other inputs; each adapter is served only its own KV, read back exactly against a full prefill."""

import json

import pytest
import torch

from conftest import full_prefill, random_ids, tiny_model
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.keys import adapter_fingerprint, request_scope

peft = pytest.importorskip("peft")
CHUNK = 8


def lora_model(adapters=("first", "second"), seed: int = 0):
    """A tiny Llama with random rank-4 LoRA adapters on q/k/v/o (large enough to change every token)."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    wrapped = peft.get_peft_model(model, config, adapter_name=adapters[0])
    for name in adapters[1:]:
        wrapped.add_adapter(name, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return wrapped.eval()


def test_each_active_adapter_is_served_only_its_own_kv_exactly(tmp_path):
    """Adapter "first" stores a document; "second", the base model (``disable_adapter()``) and a new
    process with "second" active miss it; each then stores its own, and every hit's logits are a
    full prefill's under the adapter that is active (the exact reader)."""
    model = lora_model()
    ids = random_ids(model, 4 * CHUNK + 1, seed=3)
    cache = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "disk")))

    def states():
        yield "first", None
        model.set_adapter("second")
        yield "second", None
        with model.disable_adapter():
            yield "base", None
        model.set_adapter("first")

    seen = {}  # logits are compared within float32 noise (1e-4): another adapter is off by O(1)
    for name, _ in states():
        reference, full = full_prefill(model, ids)
        seen[name] = reference
        assert cache.lookup(model, ids) == 0, name  # no other adapter's KV
        cache.store(model, ids, full)
        kv, hit = cache.retrieve(model, ids)
        assert hit == 4 * CHUNK
        with torch.inference_mode():
            logits = model(ids[:, hit:], past_key_values=kv).logits[0, -1]
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(seen["first"], seen["second"]) and not torch.allclose(seen["first"], seen["base"])
    cache.flush()
    other = lora_model()  # a new process: the same weights, "second" active
    other.set_adapter("second")
    kv, hit = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "disk"))).retrieve(other, ids)
    assert hit == 4 * CHUNK
    with torch.inference_mode():
        logits = other(ids[:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, seen["second"], rtol=1e-4, atol=1e-4)


def test_an_adapter_is_keyed_by_its_files_not_its_name(tmp_path):
    """Two adapters saved under one name differ; one adapter copied under another name (and another
    base_model_name_or_path) is the same; a folder without an adapter is a one-line typed error."""
    first, second = lora_model(seed=1), lora_model(seed=2)
    first.save_pretrained(tmp_path / "a", selected_adapters=["first"])
    second.save_pretrained(tmp_path / "b", selected_adapters=["first"])
    saved_a = tmp_path / "a" / "first" if (tmp_path / "a" / "first").is_dir() else tmp_path / "a"
    saved_b = tmp_path / "b" / "first" if (tmp_path / "b" / "first").is_dir() else tmp_path / "b"
    copy = tmp_path / "renamed"
    copy.mkdir()
    for f in saved_a.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    config = json.loads((copy / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/somewhere/else"
    (copy / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_fingerprint(saved_a) == adapter_fingerprint(copy) != adapter_fingerprint(saved_b)
    assert request_scope(adapter=adapter_fingerprint(saved_a)) != request_scope(adapter=adapter_fingerprint(saved_b))
    with pytest.raises(InvalidInputError, match="adapter"):
        adapter_fingerprint(tmp_path / "nothing-here")


def test_a_scope_joins_every_part_and_any_salt_is_a_scope():
    """Salt, adapter and inputs each change the scope; any string is a salt (a lone surrogate, 10,000
    characters) and never raises; the facade's per-call namespace is the same scope as that salt."""
    adapter = bytes(range(16))
    scopes = {request_scope("t"), request_scope("t", adapter), request_scope("t", adapter, b"image@3"),
              request_scope(None, adapter), request_scope("u"), request_scope("\udc80"), request_scope("x" * 10_000)}
    assert len(scopes) == 7 and all(len(s) == 16 for s in scopes)
    assert request_scope("t", None, b"") == request_scope("t")
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    session = KDN(KDNConfig(chunk_size=CHUNK)).session(model)
    assert session.within("t") is session.within(request_scope("t"))


def test_a_vllm_request_kdn_cannot_key_is_unservable_never_an_exception(tmp_path):
    """The scope of a vLLM request (``kdn.integrations.vllm.scope``, no vLLM needed): prompt
    embeddings, an adapter path that is not a folder here and a multimodal input without a hash are
    :class:`Unservable` (the request is served nothing); a multimodal input's hash and position, the
    adapter's files and any salt are in the scope."""
    from types import SimpleNamespace as Request

    from kdn.integrations.vllm.scope import Scopes, Unservable
    from kdn.integrations.vllm.vouch import KEYED_FIELDS

    def request(**fields):  # a vLLM Request's fields that kdn keys by, None unless given
        return Request(**{**dict.fromkeys(KEYED_FIELDS), **fields})

    scopes = Scopes()
    assert scopes.of(request()) is None
    for bad in (request(prompt_embeds=torch.zeros(3, 8)),
                request(lora_request=Request(lora_name="gone", lora_path=str(tmp_path / "nowhere"))),
                request(mm_features=[Request(identifier=None, mm_position=None)]),
                request(cache_salt=b"bytes")):
        with pytest.raises(Unservable):
            scopes.of(bad)

    def image(offset):
        return [Request(modality="image", identifier="img-1", mm_position=Request(offset=offset, length=4))]

    with_image = {scopes.of(request(mm_features=image(3))), scopes.of(request(mm_features=image(5))),
                  scopes.of(request(cache_salt="\udc80" * 3000))}
    assert len(with_image) == 3 and None not in with_image
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    lora = Request(lora_name="x", lora_path=str(folder))
    first = scopes.of(request(lora_request=lora))
    assert first == request_scope(adapter=adapter_fingerprint(folder))
    (folder / "adapter_model.safetensors").write_bytes(b"other weights")  # reloaded in place: new files
    assert scopes.of(request(lora_request=lora)) != first
