"""What a miss costs: ``KDN.generate`` on a prompt kdn has never seen vs. plain ``model.generate`` on
the same prompt, interleaved in one run (SmolLM2, one new token, 1K/3K/8K tokens). Two figures per
size: the *answer* overhead (the time until generate returns: what the user waits for) and the
*total* overhead (until the background store is done too: what the machine spends).

    python benchmarks/bench_miss.py --sizes 1000,3000,8000 --repeats 5 --out benchmarks/results/miss
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kdn  # noqa: E402
from kdn import KDN  # noqa: E402
from timing import save_result  # noqa: E402


def fresh_prompt(vocab: int, n: int, seed: int) -> torch.Tensor:
    """[1, n] random ordinary token ids: a prompt no earlier one shares a chunk with."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (1, n), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sizes", default="1000,3000,8000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out/miss")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load(args.model)
    vocab = model.config.vocab_size
    cache = KDN()
    gen = {"max_new_tokens": 1, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    rows = []
    seed = 0
    with torch.inference_mode():
        model.generate(fresh_prompt(vocab, 64, 10**6), **gen)  # warm-up
        cache.generate(model, fresh_prompt(vocab, 64, 10**6 + 1), **gen)
        cache.flush()
        for n in (int(s) for s in args.sizes.split(",")):
            plain, answer, total = [], [], []
            for _ in range(args.repeats):
                seed += 1
                ids = fresh_prompt(vocab, n, seed)
                t0 = time.perf_counter()
                ref = model.generate(ids, **gen)
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = cache.generate(model, ids, **gen)
                answer.append(time.perf_counter() - t0)
                cache.flush()  # the store, if it runs after the answer
                total.append(time.perf_counter() - t0)
                assert torch.equal(out, ref), "a miss must answer exactly as model.generate"
                assert cache.lookup(model, ids[0]) > 0, "the miss was not stored"
                cache.clear()  # keep memory flat across sizes
            row = {"tokens": n, "plain_s": statistics.median(plain), "kdn_answer_s": statistics.median(answer),
                   "kdn_total_s": statistics.median(total),
                   "answer_overhead": statistics.median(a / p for a, p in zip(answer, plain)) - 1,
                   "total_overhead": statistics.median(t / p for t, p in zip(total, plain)) - 1,
                   "answer_overhead_range": [min(a / p for a, p in zip(answer, plain)) - 1,
                                             max(a / p for a, p in zip(answer, plain)) - 1],
                   "load_average": os.getloadavg()[0]}
            rows.append(row)
            print(f"{n:>6} tokens: plain {row['plain_s'] * 1e3:7.0f} ms, kdn miss {row['kdn_answer_s'] * 1e3:7.0f} ms "
                  f"(answer {row['answer_overhead']:+.1%}, range {row['answer_overhead_range'][0]:+.1%}.."
                  f"{row['answer_overhead_range'][1]:+.1%}; with the store {row['total_overhead']:+.1%}); "
                  f"load average {row['load_average']:.1f}", flush=True)
    path = save_result(Path(args.out) / "bench_miss.json", {"model": args.model, "repeats": args.repeats,
                                                            "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
