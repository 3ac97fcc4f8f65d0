"""What computing every position's logits costs a prefill whose KV is all that is wanted (the case
``kdn.layout.prefill_cache`` serves with ``logits_to_keep=1``): one model, random token ids, the
two forwards alternated in one process. Qwen2.5's vocabulary is 151,936 tokens, so the output head
is a large share of a small model's prefill.

    python benchmarks/results/ttft/prefill_logits.py qwen2.5-coder-0.5b 1024
"""

import sys
import time

import torch

import kdn.models


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    model, _ = kdn.models.load(name)
    ids = torch.randint(100, 40000, (1, tokens))

    def run(**kwargs) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(ids, use_cache=True, **kwargs)
        return time.perf_counter() - t0

    run(), run(logits_to_keep=1)  # warm
    for _ in range(2):
        every, last = run(), run(logits_to_keep=1)
        print(f"{name}, {tokens} tokens: every position's logits {every:.2f} s, the last one's {last:.2f} s "
              f"({every / last:.2f}x)")


if __name__ == "__main__":
    main()
