"""The HF side of the cross-engine test: KDN.generate on the checkpoint vLLM serves, over token
prompts, with kdn tiers shared with a vLLM engine; prints one JSON line (hits, tokens, and how far
the logits of a kdn hit are from this process' own full prefill). Run in the vLLM venv, so both
engines see the same transformers:

    python tests/vllm_hf.py --model DIR --prompts prompts.json --kdn '{"disk_dir": "/tmp/kv"}'
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--kdn", required=True, help="KDNConfig settings as JSON")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from kdn import KDN, KDNConfig

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    kdn = KDN(KDNConfig(**json.loads(args.kdn)))
    results = []
    with open(args.prompts) as f:
        prompts = json.load(f)
    for ids in prompts:
        ids = torch.tensor([ids])
        cache, hit = kdn.retrieve(model, ids, limit=ids.shape[1] - 1)
        with torch.inference_mode():
            full = model(ids).logits[0, -1]
            served = model(ids[:, hit:], past_key_values=cache).logits[0, -1] if hit else full
        out = kdn.generate(model, ids, max_new_tokens=args.max_tokens, do_sample=False)
        results.append({"hit_tokens": hit, "tokens": out[0, ids.shape[1]:].tolist(),
                        "max_logit_diff": float((served - full).abs().max())})
    kdn.flush()
    print("KDN-RESULT " + json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
