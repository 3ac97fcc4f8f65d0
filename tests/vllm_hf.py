"""The HF side of the cross-engine test: KDN.generate on the checkpoint vLLM serves, over token
prompts, with kdn tiers shared with a vLLM engine; prints one JSON line (hits, tokens, and how far
the logits of a kdn hit are from this process' own full prefill; in bf16, where two correct
computations differ by rounding, also the served KV's error to an fp32 prefill over the bf16
prefill's). Run in the vLLM venv, so both engines see the same transformers:

    python tests/vllm_hf.py --model DIR --prompts prompts.json --kdn '{"disk_dir": "/tmp/kv"}'
"""

from __future__ import annotations

import argparse
import json

import torch


def _kv_error_ratio(served, model, fp32, ids: torch.Tensor) -> float:
    """The served KV's relative error to an fp32 prefill's, over this dtype's own prefill's (worst
    layer, keys or values): about 1 when the served KV is as close to the truth as the dtype allows,
    about 1 / rounding (hundreds) when it is another token's or another layer's KV."""
    with torch.inference_mode():
        truth = fp32(ids, use_cache=True, logits_to_keep=1).past_key_values
        own = model(ids, use_cache=True, logits_to_keep=1).past_key_values
    worst = 0.0
    for s, t, o in zip(served.layers, truth.layers, own.layers, strict=True):
        for a, b, c in ((s.keys, t.keys, o.keys), (s.values, t.values, o.values)):
            b = b.float()
            worst = max(worst, float((a.float() - b).norm() / (c.float() - b).norm()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--kdn", required=True, help="KDNConfig settings as JSON")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--namespace", default=None, help="the per-call namespace (a vLLM cache_salt's scope)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from kdn import KDN, KDNConfig

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
    fp32 = (None if args.dtype == "float32" else
            AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device))
    kdn = KDN(KDNConfig(**json.loads(args.kdn)))
    results = []
    with open(args.prompts) as f:
        prompts = json.load(f)
    for ids in prompts:
        ids = torch.tensor([ids], device=args.device)
        cache, hit = kdn.retrieve(model, ids, limit=ids.shape[1] - 1, namespace=args.namespace)
        result = {"hit_tokens": hit}
        if fp32 is not None and hit:  # before the suffix below extends the cache
            result["kv_error_vs_own_prefill"] = _kv_error_ratio(cache, model, fp32, ids[:, :hit])
        if hit:  # every layer's KV at every served position against this model's own prefill of them
            from kdn.layout import cache_to_kv_list, prefill_cache

            with torch.inference_mode():
                own = cache_to_kv_list(prefill_cache(model, ids[:, :hit]))
            result["kv_max_diff"] = max(float((a[:, :, :hit].float() - b.float()).abs().max())
                                        for a, b in zip(cache_to_kv_list(cache), own))
        with torch.inference_mode():
            full = model(ids, logits_to_keep=1).logits[0, -1]
            served = model(ids[:, hit:], past_key_values=cache, logits_to_keep=1).logits[0, -1] if hit else full
        out = kdn.generate(model, ids, max_new_tokens=args.max_tokens, do_sample=False, namespace=args.namespace)
        result.update(tokens=out[0, ids.shape[1]:].tolist(), max_logit_diff=float((served - full).abs().max()))
        results.append(result)
    kdn.flush()
    print("KDN-RESULT " + json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
