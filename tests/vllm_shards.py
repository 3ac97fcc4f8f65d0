"""An exact HF reader of what a tensor-parallel vLLM engine stored: each rank's share of the KV heads
read back under that rank's keys (as its worker reads them), against an HF full prefill's KV of those
heads, and the shares joined into one cache whose logits are compared with the full prefill's; prints
one JSON line. Run in the vLLM venv (the same transformers, so the same checkpoint fingerprint):

    python tests/vllm_shards.py --model DIR --prompts prompts.json --ranks 2 --kdn '{"disk_dir": "/tmp/kv"}'
"""

from __future__ import annotations

import argparse
import functools
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--ranks", type=int, required=True, help="the engine's tensor_parallel_size")
    parser.add_argument("--kdn", required=True, help="KDNConfig settings as JSON")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from kdn import KDNConfig
    from kdn.engine import Engine, HFTarget
    from kdn.integrations.vllm.ranks import Rank
    from kdn.layout import cache_to_kv_list, describe_checkpoint, kv_list_to_cache, layout_of, prefill_cache

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = KDNConfig(**json.loads(args.kdn))
    layout = layout_of(model)
    shares = [Rank.of(layout, r, args.ranks).heads or (0, layout.kv_heads) for r in range(args.ranks)]
    describe = functools.partial(describe_checkpoint, args.model, torch.float32, model.config)
    readers = [Engine.for_checkpoint(config, args.model, torch.float32, describe, heads) for heads in shares]
    results = []
    with open(args.prompts) as f:
        prompts = json.load(f)
    for ids in prompts:
        tokens = torch.tensor(ids, dtype=torch.int64)
        loads = [engine.load(session, tokens.numpy().astype("uint32"), len(ids) - 1, HFTarget())
                 for engine, session in readers]
        hit = min(load.hit for load in loads)
        result = {"hit_tokens": [load.hit for load in loads], "heads": shares}
        if hit:
            with torch.inference_mode():
                own = cache_to_kv_list(prefill_cache(model, tokens[None, :hit]))
            diff = 0.0
            for (first, count), load in zip(shares, loads):  # each share against its heads of the prefill
                diff = max(diff, max(float((a[:, :, :hit] - b[:, first:first + count]).abs().max())
                                     for a, b in zip(load.result, own)))
            joined = [torch.cat([load.result[i][:, :, :hit] for load in loads], dim=1) for i in range(len(own))]
            result["kv_max_diff"], result["joined_heads"] = diff, joined[0].shape[1]
            with torch.inference_mode():
                full = model(tokens[None], logits_to_keep=1).logits[0, -1]
                served = model(tokens[None, hit:], past_key_values=kv_list_to_cache(model, joined),
                               logits_to_keep=1).logits[0, -1]
            result["max_logit_diff"] = float((served - full).abs().max())
        results.append(result)
    print("KDN-RESULT " + json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
