"""`kdn demo`: questions over a bundled ~3K-token document, full prefill vs. kdn, same answers."""

from __future__ import annotations

import statistics

import torch

from kdn.data import velmora

QUESTIONS = [
    "Who founded Velmora, and in what year?",
    "Who designed the Glass Bridge?",
    "How long does the ferry to Brannock take?",
    "On which night is the Lantern Festival held?",
    "How many steps does the Needle lighthouse have?",
]


def document() -> str:
    """The bundled demo document (an invented city guide, ~2,900 SmolLM2 tokens)."""
    return velmora()


def prompt_ids(tokenizer, doc: str, question: str) -> torch.Tensor:
    """[1, n] ids: the chat template around the document followed by the question."""
    messages = [{"role": "user", "content": f"{doc}\n\nAnswer in one short sentence. {question}"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    return ids


def run_demo(num_questions: int = 3, max_new_tokens: int = 32, loaded=None) -> int:
    """Ask questions with a full prefill and with kdn; print TTFTs, speedups and answer agreement.

    ``loaded`` is an optional ``(model, tokenizer)`` already in memory (default: load SmolLM2-135M).
    Returns 0 when every kdn answer is identical to the full-prefill answer, else 1.
    """
    from kdn import KDN
    from kdn.integrations.hf import FirstTokenTimer
    from kdn.models import load

    num_questions = max(1, min(num_questions, len(QUESTIONS)))
    if loaded is None:
        print("loading SmolLM2-135M-Instruct (fp32 on the CPU) ...", flush=True)
        loaded = load("smollm2-135m")
    model, tokenizer = loaded
    doc = document()
    cache = KDN()
    gen = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    with torch.inference_mode():
        model.generate(prompt_ids(tokenizer, "Warm-up.", "Hi?"), **{**gen, "max_new_tokens": 2})
        cache.session(model)  # kdn fingerprints the model once (its weights' BLAKE3), before any timing
        print(f"document: {prompt_ids(tokenizer, doc, '').shape[1]} tokens; chunk size {cache.config.chunk_size}\n")
        print(f"{'#':>2} {'prompt':>6} {'from kdn':>8} {'TTFT full':>10} {'TTFT kdn':>9} {'speedup':>8}  same  answer")
        speedups, misses, all_match = [], [], True
        for i, question in enumerate(QUESTIONS[:num_questions], 1):
            ids = prompt_ids(tokenizer, doc, question)
            full_timer = FirstTokenTimer()  # the reference first: the first long forward warms the allocator
            ref = model.generate(ids, streamer=full_timer, **gen)
            kdn_timer = FirstTokenTimer()
            out = cache.generate(model, ids, streamer=kdn_timer, **gen)
            hit = cache.last_generate["hit_tokens"]
            same = torch.equal(out, ref)
            all_match &= same
            speedup = full_timer.ttft / kdn_timer.ttft
            (speedups if hit else misses).append(speedup)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip().replace("\n", " ")
            print(f"{i:>2} {ids.shape[1]:>6} {hit:>8} {full_timer.ttft * 1e3:>8.0f}ms {kdn_timer.ttft * 1e3:>7.0f}ms "
                  f"{speedup:>7.1f}x  {'yes' if same else 'NO':>4}  {question} -> {answer[:70]}")
    print()
    if misses:
        print(f"a miss (nothing stored yet) cost {1 / statistics.mean(misses) - 1:+.1%} over a plain prefill "
              "in time to first token (the lookup; the new KV is stored after the last token; noise is a few %)")
    if speedups:
        print(f"time-to-first-token with the document served from kdn: {statistics.mean(speedups):.1f}x faster "
              f"(mean over {len(speedups)} cached questions); first question prefilled in full and stored.")
    print("answers identical to full prefill: " + ("yes" if all_match else "NO"))
    stats = cache.stats()["memory"]
    print(f"kdn memory tier: {stats['entries']} entries (KV chunks and their pointers), "
          f"{stats['used_bytes'] / 2**20:.1f} MiB")
    return 0 if all_match else 1
