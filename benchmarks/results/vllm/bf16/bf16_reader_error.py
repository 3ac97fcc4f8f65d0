"""Why the bf16 vLLM test checks KV, not logits: per layer, the relative error of the KV a bf16 vLLM
engine stored (served by kdn to an HF bf16 model) against an HF fp32 prefill, beside the HF bf16
prefill's own; then the max logit differences (served vs own bf16 prefill, own bf16 vs fp32).
Run in the vLLM venv on a folder a bf16 engine filled (tests/test_vllm.py's bf16 test keeps it in
pytest's tmp dir):

    python bf16_reader_error.py MODEL_DIR PROMPTS_JSON KV_DIR
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from kdn import KDN, KDNConfig


def main() -> None:
    model_dir, prompts, disk = sys.argv[1:4]
    ids = torch.tensor([json.load(open(prompts))[0]])
    b16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    f32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cache, hit = KDN(KDNConfig(disk_dir=disk)).retrieve(b16, ids, limit=ids.shape[1] - 1)
    print("hit", hit)
    with torch.inference_mode():
        truth = f32(ids[:, :hit], use_cache=True, logits_to_keep=1).past_key_values
        own = b16(ids[:, :hit], use_cache=True, logits_to_keep=1).past_key_values

    def err(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    for i, (s, t, o) in enumerate(zip(cache.layers, truth.layers, own.layers, strict=True)):
        print(f"layer {i:2d} K served {err(s.keys, t.keys):.4f} hf-bf16 {err(o.keys, t.keys):.4f} | "
              f"V served {err(s.values, t.values):.4f} hf-bf16 {err(o.values, t.values):.4f}")
    with torch.inference_mode():
        served = b16(ids[:, hit:], past_key_values=cache, logits_to_keep=1).logits[0, -1].float()
        full16 = b16(ids, logits_to_keep=1).logits[0, -1].float()
        full32 = f32(ids, logits_to_keep=1).logits[0, -1]
    print(f"max logit diff: served vs own bf16 prefill {float((served - full16).abs().max()):.3f}; "
          f"own bf16 vs fp32 {float((full16 - full32).abs().max()):.3f}; "
          f"served vs fp32 {float((served - full32).abs().max()):.3f}")


if __name__ == "__main__":
    main()
