"""KV codecs on real KV (SmolLM2-135M and stories260K over LongChat and MuSiQue contexts): size vs
fp16, relative L2 error per layer, KL of the next-token distribution and greedy-token agreement over
generated tokens vs the uncompressed KV, encode/decode speed, the entropy coder's distance to its
model, beside zstandard and HF's quantized cache (quanto) at 4 and 2 bits.

Usage: python benchmarks/bench_codecs.py [--models smollm2,stories260k] [--contexts 20] [--tokens 1024]
       [--gen 64] [--kvtc-ratios 6,8,10,12,16] [--calibration 8] [--codecs all] [--out benchmarks/results/codecs]
``kvtc`` is calibrated per model on ``--calibration`` contexts disjoint in content from the evaluated
ones (:func:`kdn.eval.runner.calibration_contexts`: the next samples' conversations and passages that
share no 8-word run with them; by index alone, LongChat records 10-13 held 13-84% of their 8-word runs
in the evaluated contexts). Writes bench_codecs.json and the rate-quality frontier of every
codec (size vs KL and vs agreement) to bench_codecs_frontier.png.
Agreement is teacher-forced: the model continues the reference generation (64 greedy tokens with the
uncompressed KV) on top of the decoded KV, and we count the positions whose argmax is the reference
token; KL is KL(reference || codec) at the same positions, in nats. Speeds count fp16 bytes of KV.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kdn import KDN, KDNConfig, _core, codecs, kvtc
from kdn.eval import load_dataset
from kdn.eval.runner import calibration_contexts
from kdn.layout import cache_to_kv_list
from timing import save_result, timed

CODECS = ["lossless", "int8", "int4", "int2", "cachegen:level=1", "cachegen", "cachegen:level=3",
          "cachegen:anchor=1"]
CHUNK = 256


def pool() -> list:
    """LongChat topics and MuSiQue samples, alternating: the first ``--contexts`` are evaluated."""
    sets = [load_dataset("longchat-topics-5"), load_dataset("musique")]
    return [sets[i % 2][i // 2] for i in range(2 * min(map(len, sets)))]


def encoded(tokenizer, samples: list, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(context ids cut to `tokens`, question ids) of each sample (a short context repeated)."""
    out = []
    for s in samples:
        ids = tokenizer("\n".join(s.segments))["input_ids"]
        if len(ids) < tokens:
            ids = (ids * (tokens // len(ids) + 1))
        out.append((ids[:tokens], tokenizer(s.query, add_special_tokens=False)["input_ids"][:48]))
    return out


def kl_and_agreement(ref_logits: torch.Tensor, logits: torch.Tensor, ref_tokens: torch.Tensor) -> tuple[float, float]:
    p, q = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())  # same greedy token
    return kl, agree


@torch.inference_mode()
def continuation_logits(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits at the last question token and each generated token, given the cache of ids[:start]."""
    q = len(ids) - start
    return model(ids[None, start:], past_key_values=cache).logits[0, q - 1 - GEN:]


def layer_errors(reference: torch.Tensor, decoded: torch.Tensor) -> list[float]:
    """Relative L2 error of each layer (keys and values together) of canonical chunks."""
    dims = tuple(d for d in range(reference.dim()) if d != 0)
    norm = torch.linalg.vector_norm
    return (norm(decoded - reference, dim=dims) / norm(reference, dim=dims)).tolist()


def quanto_round_trip(model, kv: list[torch.Tensor], bits: int):
    """HF QuantizedCache (quanto backend) quantize + dequantize of every layer, its default axes."""
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=model.config, nbits=bits, residual_length=0, q_group_size=64)
    layer = cache.layers[0]
    return [layer._dequantize(layer._quantize(t.contiguous(), axis=layer.axis_key)).to(t.dtype) for t in kv]


def speed(blob, spec: str) -> dict:
    fp16 = blob_bytes_fp16(blob)
    coded = codecs.encode(blob, spec)
    enc = timed(lambda: codecs.encode(blob, spec), repeats=5)
    dec = timed(lambda: _core.transcode(coded, 0, 0), repeats=5)
    return {"encode_GBps": fp16 / enc / 1e9, "decode_GBps": fp16 / dec / 1e9}


def cast_blob(blob, dtype):
    """The chunk of a blob re-packed in another dtype."""
    kv = codecs.decode(blob).to(dtype)
    per_layer = [kind[None].permute(0, 2, 1, 3).contiguous() for layer in kv for kind in layer]
    h = _core.blob_parse(blob, verify_checksum=False)  # same model: kvtc finds its calibration
    return _core.pack_chunk(per_layer, 0, kv.shape[2], h["fingerprint"], h["key"])


def blob_bytes_fp16(blob) -> int:
    h = _core.blob_parse(blob, verify_checksum=False)
    return h["layers"] * 2 * h["tokens"] * h["kv_heads"] * h["head_dim"] * 2


def run_model(name: str, args) -> dict:
    from kdn.models import load

    model, tokenizer = load(name)
    model.eval()
    rows: dict[str, dict] = {}

    def add(method, **values):
        row = rows.setdefault(method, {"kl": [], "agree": [], "ratio": [], "layer_err": []})
        for k, v in values.items():
            row[k].append(v)

    reports: dict[str, dict] = {}
    speed_blob = None
    room = getattr(model.config, "max_position_embeddings", 1 << 20) - 48 - GEN - 8
    tokens = min(args.tokens, room // CHUNK * CHUNK)  # stories260K reads at most 512 tokens
    specs = [s for s in CODECS + [f"kvtc:ratio={r}" for r in args.kvtc_ratios.split(",") if r]
             if args.codecs == "all" or s.split(":")[0] in args.codecs.split(",")]
    if any(s.startswith("kvtc") for s in specs):
        t0 = time.perf_counter()
        everything = pool()  # text sharing no conversation, passage or 8-word run with the evaluated contexts
        chosen = calibration_contexts(everything, everything[:args.contexts], args.calibration)
        if len(chosen) < args.calibration:
            raise SystemExit(f"kvtc: {len(chosen)} of {args.calibration} calibration contexts share no text with the "
                             f"{args.contexts} evaluated ones: lower --contexts or --calibration, or add data")
        disjoint = [c for c, _ in encoded(tokenizer, chosen, tokens)]
        calibration = kvtc.calibrate(model, disjoint, prerope=not args.no_prerope, key_weight=args.key_weight,
                                     progress=False)
        kvtc.load(calibration)
        print(f"  {name}: kvtc calibration on {args.calibration} disjoint contexts in "
              f"{time.perf_counter() - t0:.0f} s, {len(calibration) / 1e6:.1f} MB", flush=True)
    for i, (ctx, question) in enumerate(encoded(tokenizer, pool()[:args.contexts], tokens)):
        ids = torch.tensor(ctx + question)
        with torch.inference_mode():
            out = model(ids[None, : len(ctx)], use_cache=True)
            kv = [t.clone() for t in cache_to_kv_list(out.past_key_values)]
            pairs = tuple(zip(kv[0::2], kv[1::2]))
            gen = model.generate(ids[None], past_key_values=out.past_key_values, max_new_tokens=GEN, do_sample=False,
                                 min_new_tokens=GEN, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        ref_tokens = gen[0, len(ids):]
        full = torch.cat([ids, ref_tokens])
        base = KDN(KDNConfig(chunk_size=CHUNK))
        base.store(model, ctx, pairs)
        cache, hit = base.retrieve(model, ctx, limit=len(ctx))
        ref_logits = continuation_logits(model, cache, full, hit)
        keys = base.chunk_keys(model, ctx)
        raw_blobs = [base.memory.get(k) for k in keys]
        reference = torch.cat([codecs.decode(b) for b in raw_blobs], dim=2)
        if speed_blob is None:  # speeds are measured on one chunk cast to fp16 (what the GB/s count)
            speed_blob = cast_blob(raw_blobs[0], torch.float16)
        fp16_bytes = sum(blob_bytes_fp16(b) for b in raw_blobs)
        for spec in specs:
            kdn = KDN(KDNConfig(chunk_size=CHUNK, memory_codec=spec))
            kdn.store(model, ctx, pairs)
            cache, hit = kdn.retrieve(model, ctx, limit=len(ctx))
            kl, agree = kl_and_agreement(ref_logits, continuation_logits(model, cache, full, hit), ref_tokens)
            coded = [kdn.memory.get(codecs.address(k, spec)) for k in keys]
            decoded = torch.cat([codecs.decode(b) for b in coded], dim=2)
            add(spec, kl=kl, agree=agree, ratio=fp16_bytes / sum(len(b) for b in coded),
                layer_err=layer_errors(reference, decoded))
            if spec in ("lossless",) or spec.startswith(("cachegen", "kvtc")):
                for b in raw_blobs:
                    _, rep = codecs.encode(b, spec, report=True)
                    acc = reports.setdefault(spec, {})
                    for k, v in rep.items():
                        acc[k] = acc.get(k, 0) + v
        for bits in (4, 2) if args.codecs == "all" else ():
            try:
                approx = quanto_round_trip(model, kv, bits)
            except Exception as e:  # optional baseline
                rows.setdefault(f"hf-quanto-int{bits}", {"error": str(e)})
                continue
            cache = base.retrieve(model, ctx, limit=len(ctx))[0]
            for layer, (k, v) in enumerate(zip(approx[0::2], approx[1::2])):
                cache.layers[layer].keys, cache.layers[layer].values = k, v
            kl, agree = kl_and_agreement(ref_logits, continuation_logits(model, cache, full, len(ctx)), ref_tokens)
            values = sum(t.numel() for t in kv)
            nominal = values * bits / 8 + values / 64 * 4  # bits per value + fp16 scale and shift per group of 64
            pairs_q = zip(approx[0::2], approx[1::2])
            canon = torch.stack([torch.stack([a, b]) for a, b in pairs_q])[:, :, 0].transpose(2, 3)
            add(f"hf-quanto-int{bits}", kl=kl, agree=agree, ratio=values * 2 / nominal,
                layer_err=layer_errors(reference, canon.contiguous()))
        print(f"  {name}: context {i + 1}/{args.contexts} done", flush=True)

    table = {}
    for method, row in rows.items():
        if "error" in row:
            table[method] = row
            continue
        errs = np.array(row["layer_err"])
        table[method] = {"ratio_vs_fp16": statistics.mean(row["ratio"]), "kl_mean": statistics.mean(row["kl"]),
                         "agreement": statistics.mean(row["agree"]), "rel_l2_mean": float(errs.mean()),
                         "rel_l2_per_layer": errs.mean(0).round(5).tolist(), "contexts": len(row["kl"])}
    for spec in specs:
        table[spec].update(speed(speed_blob, spec))
    for spec, rep in reports.items():
        table[spec]["coded_over_model_bits"] = rep["coded_bytes"] * 8 / rep["model_bits"]
        table[spec]["model_over_empirical_bits"] = rep["model_bits"] / rep["empirical_bits"]
        total = rep["coded_bytes"] + rep["table_bytes"] + rep["side_bytes"]
        table[spec]["table_bytes_share"] = rep["table_bytes"] / total
        table[spec]["side_bytes_share"] = rep["side_bytes"] / total
    if args.codecs == "all":
        table.update(zstd_rows(speed_blob))
    return table


def zstd_rows(blob) -> dict:
    """zstandard on the raw bytes of one chunk's KV in bf16 and fp16, beside `lossless`."""
    import zstandard

    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        tag = str(dtype).split(".")[1]
        ours = cast_blob(blob, dtype)
        raw = bytes(memoryview(ours)[80:-8])
        coded = codecs.encode(ours, "lossless")
        out[f"lossless ({tag})"] = {"ratio": len(raw) / (len(coded) - 88), **speed(ours, "lossless")}
        for level in (1, 3, 9):
            c = zstandard.ZstdCompressor(level=level)
            z = c.compress(raw)
            d = zstandard.ZstdDecompressor()
            enc, dec = timed(lambda: c.compress(raw), repeats=5), timed(lambda: d.decompress(z), repeats=5)
            out[f"zstd-{level} ({tag})"] = {"ratio": len(raw) / len(z), "encode_GBps": len(raw) / enc / 1e9,
                                           "decode_GBps": len(raw) / dec / 1e9}
    return out


def print_table(name: str, table: dict) -> None:
    print(f"\n{name}")
    print("| codec | ratio vs fp16 | rel L2 | KL (nats) | agreement | encode GB/s | decode GB/s | coded/model bits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method, r in table.items():
        if "error" in r:
            print(f"| {method} | unavailable: {r['error'][:60]} |")
            continue
        ratio = r.get("ratio_vs_fp16", r.get("ratio"))
        g = lambda k: r.get(k, float("nan"))  # noqa: E731
        print(f"| {method} | {ratio:.2f} | {g('rel_l2_mean'):.4f} | {g('kl_mean'):.4f} | {g('agreement'):.3f} "
              f"| {g('encode_GBps'):.2f} | {g('decode_GBps'):.2f} | {g('coded_over_model_bits'):.4f} |")


def print_limits(table: dict) -> None:
    rows = {m: r for m, r in table.items() if "coded_over_model_bits" in r}
    if not rows:
        return
    print("\n| codec | coded / model bits | model / empirical bits | table bytes | side bytes |")
    print("|---|---:|---:|---:|---:|")
    for method, r in rows.items():
        print(f"| {method} | {r['coded_over_model_bits']:.4f} | {r['model_over_empirical_bits']:.4f} "
              f"| {100 * r['table_bytes_share']:.2f}% | {100 * r['side_bytes_share']:.2f}% |")


def main() -> None:
    global GEN
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2-135m,stories260k")
    parser.add_argument("--contexts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--kvtc-ratios", default="6,8,10,12,16")
    parser.add_argument("--calibration", type=int, default=8, help="kvtc calibration contexts (disjoint)")
    parser.add_argument("--key-weight", type=float, default=kvtc.KEY_WEIGHT)
    parser.add_argument("--no-prerope", action="store_true", help="kvtc: calibrate and code keys post-RoPE")
    parser.add_argument("--codecs", default="all", help="comma-separated codec names to run (e.g. kvtc), or all")
    parser.add_argument("--out", default="benchmarks/results/codecs")
    args = parser.parse_args()
    GEN = args.gen
    torch.manual_seed(0)
    results = {"threads": _core.default_num_threads(), "args": vars(args), "models": {}}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        results["models"][name] = run_model(name, args)
        print_table(f"{name} ({args.contexts} contexts, up to {args.tokens} tokens, {time.perf_counter() - t0:.0f} s)",
                    results["models"][name])
        print_limits(results["models"][name])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_result(out / "bench_codecs.json", results, indent=1)
    plot_frontier(results["models"], out / "bench_codecs_frontier.png")
    print(f"\nwrote {out / 'bench_codecs.json'} and bench_codecs_frontier.png")


def plot_frontier(models: dict, path: Path) -> None:
    """Size vs fp16 against KL and against agreement, every codec of every model on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.5 * len(models)), squeeze=False)
    for (name, table), (left, right) in zip(models.items(), axes):
        families: dict[str, list] = {}
        for method, r in table.items():
            if "kl_mean" in r and method != "lossless":
                families.setdefault(method.split(":")[0].split("-int")[0], []).append(
                    (r["ratio_vs_fp16"], max(r["kl_mean"], 1e-6), r["agreement"], method))
        for family, points in families.items():
            points.sort()
            x, kl, agree, _ = zip(*points)
            style = "-o" if family == "kvtc" else "o"
            left.plot(x, kl, style, label=family)
            right.plot(x, agree, style, label=family)
            for xi, ki, _, m in points:
                left.annotate(m.split(":")[-1], (xi, ki), fontsize=6)
        left.axhline(0.05, color="gray", ls=":")
        left.axvline(8, color="gray", ls=":")
        right.axhline(0.95, color="gray", ls=":")
        right.axvline(8, color="gray", ls=":")
        left.set(title=f"{name}: KL vs size", xlabel="smaller than fp16 (x)", ylabel="KL vs exact KV (nats)",
                 yscale="log")
        right.set(title=f"{name}: greedy agreement vs size", xlabel="smaller than fp16 (x)", ylabel="agreement")
        left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


GEN = 64

if __name__ == "__main__":
    main()
