"""A hybrid model's hit in the HF face beside a plain model's, one run: time to the first token of a
context and a real question, full prefill against a kdn memory hit, for a Granite-4-H-shaped hybrid
(mamba2 layers beside a few attention layers) and a full-attention model of the same width and
depth (random weights, SmolLM2's tokenizer and vocabulary).

Usage: python benchmarks/bench_hybrid.py [--lengths 1024,2048,4096] [--repeats 3] [--out bench_out]
Both sides are ``generate(max_new_tokens=1)`` over the same prompt: ``model.generate`` alone, and
``KDN.generate`` served the context stored by a first call (the hybrid: its attention chunks and the
state at the context's last chunk boundary; the question computed over them), alternated
``--repeats`` times; the record keeps every run, the medians, the stored bytes and whether the
token matched. transformers' PyTorch reference scans run the mamba layers (no mamba_ssm kernels here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from kdn import KDN, KDNConfig
from timing import QUESTION, question_ids, save_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from model_families import random_model  # noqa: E402

WIDTH, LAYERS, ATTENTION_EVERY = 576, 12, 4  # SmolLM2-135M's width and half its depth; 1 attention layer in 4


def configs(vocab: int) -> dict:
    common = dict(vocab_size=vocab, hidden_size=WIDTH, intermediate_size=1536, num_hidden_layers=LAYERS,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    kinds = ["attention" if i % ATTENTION_EVERY == ATTENTION_EVERY - 1 else "mamba" for i in range(LAYERS)]
    return {
        "granite-4-h": transformers.GraniteMoeHybridConfig(
            **common, shared_intermediate_size=1536, num_local_experts=0, num_experts_per_tok=0, layer_types=kinds,
            mamba_n_heads=18, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=256, position_embedding_type="rope"),
        "full-attention": transformers.LlamaConfig(**common, head_dim=64),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    import kdn.demo  # noqa: F401  (bundled document)
    from kdn.models import smollm2

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2.converted_dir(smollm2.gguf_path()))
    torch.set_grad_enabled(False)
    question = question_ids(tokenizer, QUESTION)
    text = tokenizer(kdn.demo.document(), return_tensors="pt").input_ids
    rows = []
    for family, config in configs(len(tokenizer)).items():
        model = random_model(config)
        for n in [int(x) for x in args.lengths.split(",")]:
            context = text.repeat(1, -(-n // text.shape[1]))[:, :n]
            prompt = torch.cat([context, question], dim=1)
            cache = KDN(KDNConfig())
            cache.generate(model, torch.cat([context, question[:, :1]], dim=1), max_new_tokens=1)  # stores the context
            full_runs, hit_runs, same = [], [], True
            for _ in range(args.repeats):  # alternate, so both see the same load
                t0 = time.perf_counter()
                want = model.generate(prompt, max_new_tokens=1, do_sample=False)
                full_runs.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = cache.generate(model, prompt, max_new_tokens=1, do_sample=False, store=False)
                hit_runs.append(time.perf_counter() - t0)
                same = same and torch.equal(got, want)
            stats = cache.last_generate
            full_s, hit_s = statistics.median(full_runs), statistics.median(hit_runs)
            row = {"family": family, "tokens": n, "question_tokens": question.shape[1],
                   "hit_tokens": stats["hit_tokens"],
                   "stored_bytes": cache.stats()["memory"]["used_bytes"], "full_prefill_s": full_s,
                   "full_prefill_runs_s": full_runs, "kdn_hit_s": hit_s, "kdn_hit_runs_s": hit_runs,
                   "speedup": full_s / hit_s, "same_token": same}
            rows.append(row)
            print(f"{family:>14} {n:>6} tokens  hit {row['hit_tokens']:>5}  "
                  f"stored {row['stored_bytes'] / 2**20:7.1f} MiB  full prefill {full_s * 1e3:8.0f} ms  "
                  f"kdn hit {hit_s * 1e3:6.0f} ms  speedup {row['speedup']:6.1f}x  "
                  f"same token {same}", flush=True)
    out = save_result(Path(args.out) / "bench_hybrid.json", {
        "what": "generate(max_new_tokens=1) of context + question: model.generate alone vs KDN.generate served the "
                "context from memory, alternated; medians", "width": WIDTH, "layers": LAYERS,
        "attention_every": ATTENTION_EVERY, "question": QUESTION, "threads": torch.get_num_threads(), "rows": rows})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
