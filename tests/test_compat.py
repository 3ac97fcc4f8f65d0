"""Never wrong on another release (issue 80): what the HF face reads of transformers' caches and
PEFT's adapters is checked at first use per model (:mod:`kdn.integrations.hf.vouch`); a reading kdn
cannot vouch for — simulated here by changing what the library reports — is a refusal by name: the
model's own tokens, nothing served, nothing stored, one warning. ``kdn.compat`` says where each
installed version stands against the range CI's matrix tested."""

import logging

import pytest
import torch
import transformers

from conftest import random_ids
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.compat import TESTED, UnvouchedError, versions, within
from kdn.integrations.hf import vouch
from kdn.models.tiny import tiny_model

CHUNK = 16


def _families():
    from model_families import deepseek_v2_config, gemma3_config, granite_hybrid_config, qwen3_next_config, random_model

    return {
        "llama": lambda: tiny_model("llama"),
        "gemma3-sliding": lambda: random_model(gemma3_config(window=8)),
        "mla": lambda: random_model(deepseek_v2_config()),
        "granite-4-h": lambda: random_model(granite_hybrid_config()),
        "qwen3-next": lambda: random_model(qwen3_next_config()),
    }


@pytest.mark.parametrize("family", ["llama", "gemma3-sliding", "mla", "granite-4-h", "qwen3-next"])
def test_kdns_reading_of_every_cache_kind_is_vouched_for_on_the_installed_transformers(family):
    """Full attention, sliding windows, MLA latents and both hybrids: kdn's hit path on the canary
    prompt gives the model's own logits on this transformers, so each is served."""
    model = _families()[family]()
    layout = KDN().session(model).layout
    assert vouch.reason(model, layout) is None


@pytest.mark.parametrize("family", ["llama", "granite-4-h"])
def test_a_release_that_counts_a_cache_otherwise_is_refused_with_the_models_own_tokens(family, monkeypatch, caplog):
    """A cache that reports one token more than it holds (what transformers 5.25 did to a rebuilt
    hybrid cache: its state layers counted 0): generate answers the model's own tokens with nothing
    served or stored, lookup and retrieve serve nothing, deposit raises by name; one warning."""
    model = _families()[family]()
    ids = random_ids(model, 3 * CHUNK + 5, seed=2)
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    cache = KDN(KDNConfig(chunk_size=CHUNK))
    real = transformers.DynamicCache.get_seq_length
    with monkeypatch.context() as changed:  # the release kdn meets at first use
        changed.setattr(transformers.DynamicCache, "get_seq_length", lambda self, i=0: real(self, i) + 1)
        assert "counts" in vouch.reason(model, cache.session(model).layout)
    with caplog.at_level(logging.WARNING, logger="kdn"):
        for _ in range(2):
            out = cache.generate(model, ids, max_new_tokens=5, do_sample=False)
            assert torch.equal(out, want)
            assert cache.last_generate == {"hit_tokens": 0, "prompt_tokens": ids.shape[1], "refused": True}
        assert cache.lookup(model, ids) == 0 and cache.stats()["memory"]["used_bytes"] == 0
        if family == "llama":
            assert cache.retrieve(model, ids) == (None, 0)
            assert cache.store(model, ids, model(ids, use_cache=True).past_key_values) == 0
            with pytest.raises(UnvouchedError, match="KDN.deposit refuses"):
                cache.deposit(model, ids[0].tolist())
            assert cache.stats()["memory"]["used_bytes"] == 0
    warnings = [r.getMessage() for r in caplog.records if "served nothing" in r.getMessage()]
    assert any("KDN.generate" in w for w in warnings) and len([w for w in warnings if "KDN.generate" in w]) == 1


def test_a_reading_whose_kv_is_not_the_models_is_refused(monkeypatch):
    """kdn reads K and V from the cache's layers: a release that kept them in another order (heads
    reversed, here) gives other logits on the canary, and the model is refused by name."""
    model = tiny_model("llama")
    layout = KDN().session(model).layout
    real = vouch.cache_to_kv_list
    monkeypatch.setattr(vouch, "cache_to_kv_list", lambda cache: [t.flip(1) for t in real(cache)])
    why = vouch.reason(model, layout)
    assert why is not None and "from the model's own forward" in why


def test_a_peft_reading_that_does_not_follow_the_adapter_switch_is_refused(monkeypatch):
    """kdn keys an HF PEFT model's active adapters (:func:`kdn.keys.adapter_state`): a PEFT whose
    layers it read the same with the adapters on and off would share keys between them: refused."""
    peft = pytest.importorskip("peft")
    from test_adapters import lora_model

    model = lora_model()
    layout = KDN().session(model).layout
    assert vouch.reason(model, layout) is None
    model = lora_model()
    monkeypatch.setattr(peft.tuners.tuners_utils.BaseTunerLayer, "disable_adapters", property(lambda self: False))
    why = vouch.reason(model, layout)
    assert why is not None and "adapters off does not change" in why


def test_versions_name_each_library_against_its_tested_range():
    """``kdn.compat.versions`` holds torch, transformers and PEFT with the installed version inside
    the tested range here (CI runs the lowest and newest of each); a version outside is False."""
    rows = {row["package"]: row for row in versions()}
    assert rows["transformers"]["installed"] == transformers.__version__
    assert rows["transformers"]["inside"] is True and rows["torch"]["tested"] == TESTED["torch"]
    assert within("transformers", "4.57.6") is False and within("transformers", "6.0.0") is False
    assert within("peft", None) is None
    with pytest.raises(InvalidInputError):
        raise UnvouchedError("an UnvouchedError is an InvalidInputError")


def test_kdn_version_and_info_name_the_versions_against_the_tested_ranges(capsys):
    """``kdn --version`` prints kdn's version; ``kdn info`` each library kdn reads the internals of,
    with the range CI tested (a version outside it is said to be so)."""
    import kdn
    from kdn.cli import main
    from kdn.info import _against_tested

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"kdn {kdn.__version__}"
    assert main(["info"]) in (0, None)
    out = capsys.readouterr().out
    assert f"{transformers.__version__} (tested {TESTED['transformers'][0]} - {TESTED['transformers'][1]})" in out
    outside = {"package": "transformers", "installed": "5.14.1", "tested": TESTED["transformers"], "inside": False}
    assert "OUTSIDE the tested" in _against_tested(outside)
