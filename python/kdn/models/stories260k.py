"""stories260K (llama2.c checkpoint shipped in this package) as an HF LlamaForCausalLM + `tokenizers` tokenizer."""

from __future__ import annotations

import importlib.resources
import struct
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kdn.models.paths import ModelNotAvailableError

_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>"}


def model_dir() -> Path:
    """The folder inside the installed package that holds stories260K.bin, tok512.bin and their LICENSE."""
    return Path(str(importlib.resources.files("kdn.models").joinpath("stories260K")))


def _files() -> tuple[Path, Path]:
    folder = model_dir()
    weights, tok = folder / "stories260K.bin", folder / "tok512.bin"
    if not weights.exists() or not tok.exists():
        raise ModelNotAvailableError(f"stories260K files are missing from {folder}; reinstall kdn")
    return weights, tok


def read_tokenizer_pieces(path: Path) -> list[tuple[bytes, float]]:
    """(piece bytes, score) records of a llama2.c tokenizer file."""
    data = path.read_bytes()
    offset, pieces = 4, []
    while offset < len(data):
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        pieces.append((data[offset : offset + length], score))
        offset += length
    return pieces


def build_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """An HF fast tokenizer equivalent to llama2.c's encode(): BPE by piece score with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    pieces = read_tokenizer_pieces(path)
    vocab = {}
    for i, (raw, _) in enumerate(pieces):
        vocab[_SPECIAL.get(i, raw.decode("utf-8", errors="replace"))] = i
    ranked = sorted(range(259, len(pieces)), key=lambda i: (-pieces[i][1], i))
    merges = []
    for i in ranked:
        piece = pieces[i][0].decode("utf-8", errors="replace")
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=False))
    tok.normalizer = normalizers.Prepend(" ")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    # llama2.c interleaves rotary pairs; HF rotates halves: reorder the rows of wq / wk per head.
    out_dim, in_dim = w.shape
    return w.reshape(heads, out_dim // heads // 2, 2, in_dim).transpose(0, 2, 1, 3).reshape(out_dim, in_dim)


def load_stories260k() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Build the model from the llama2.c v0 export (header of 7 int32, then fp32 weights)."""
    weights_path, tok_path = _files()
    data = weights_path.read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack_from("<7i", data, 0)
    shared_classifier = vocab > 0
    vocab = abs(vocab)
    floats = np.frombuffer(data, dtype="<f4", offset=28)
    head = dim // heads
    pos = 0

    def take(*shape):
        nonlocal pos
        n = int(np.prod(shape))
        arr = floats[pos : pos + n].reshape(shape)
        pos += n
        return arr

    emb = take(vocab, dim)
    attn_norm = take(layers, dim)
    wq, wk = take(layers, dim, dim), take(layers, kv_heads * head, dim)
    wv, wo = take(layers, kv_heads * head, dim), take(layers, dim, dim)
    ffn_norm = take(layers, dim)
    w1, w2, w3 = take(layers, hidden, dim), take(layers, dim, hidden), take(layers, hidden, dim)
    norm = take(dim)
    config = LlamaConfig(
        hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=seq_len, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=shared_classifier, hidden_act="silu",
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    state = {"model.embed_tokens.weight": emb, "model.norm.weight": norm}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": attn_norm[i],
            p + "self_attn.q_proj.weight": _permute_rotary(wq[i], heads),
            p + "self_attn.k_proj.weight": _permute_rotary(wk[i], kv_heads),
            p + "self_attn.v_proj.weight": wv[i],
            p + "self_attn.o_proj.weight": wo[i],
            p + "post_attention_layernorm.weight": ffn_norm[i],
            p + "mlp.gate_proj.weight": w1[i],
            p + "mlp.down_proj.weight": w2[i],
            p + "mlp.up_proj.weight": w3[i],
        })
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}
    if shared_classifier:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"stories260K weight mapping incomplete: missing={missing} unexpected={unexpected}")
    return model.eval(), build_tokenizer(tok_path)
