"""Would kvzip x kvtc reach >= 20x within a point if kvtc coded each kept (row, head) block alone?
A simulation on Qwen2.5-Coder-1.5B, LongChat lines (the task of ``bench_editing.py --task lines``).

kvtc cannot code kvzip's pooled rows (``../pooled_codecs/``). The fix proposed there: kvtc with one
PCA basis per KV head and the chunk's mask known to coder and decoder, so only kept blocks are coded
and each with its own head's statistics. This script simulates that codec in numpy before anyone
writes it in C++: a per-(layer, K/V, KV head) calibration fit with ``kdn.kvtc``'s own plane fit,
rate-distortion curves and bit allocation (keys pre-RoPE, positions below 4 exact, as kvtc does),
applied to the kept rows an edited hit serves (``kvzip.unpool`` wrapped: the rows are quantized
and reconstructed as that codec would), and the bytes *estimated* as the empirical entropy of each
coded component's symbols over the document's kept rows, plus 16 bits per exact value and the mask.
Answers are real (greedy generation on the simulated KV); bytes are an estimate, not a stored size.

    python masked_kvtc_sim.py --records 5 --questions 5 --configs 8:1,8:0.5,8:0.3,16:1,16:0.5,16:0.3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import kdn  # noqa: E402
from bench_editing import line_records, shared_context  # noqa: E402
from kdn import KDN, KDNConfig, _core, codecs, kvtc  # noqa: E402
from kdn.demo import prompt_ids  # noqa: E402
from kdn.edits import kvzip  # noqa: E402
from kdn.eval.stats import bootstrap_ci, paired_difference  # noqa: E402
from kdn.layout import cache_to_kv_list  # noqa: E402
from kdn.rope import inv_freq as model_inv_freq  # noqa: E402

SINK = kvtc.SINK


def turn(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, back: bool) -> torch.Tensor:
    """Rows ``[n, dim]`` (rotate-half RoPE) turned back to pre-RoPE (``back``) or forward again."""
    angle = positions.double()[:, None] * inv_freq[None]
    if x.dim() == 3:  # [n, heads, dim]
        angle = angle[:, None]
    cos, sin = angle.cos(), angle.sin() * (1 if back else -1)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)


def fit_per_head(kvs, ratios, inv_freq, joint=False):
    """``{ratio: [plane dicts]}`` from the calibration contexts' KV (``kvs``: one ``2 * layers``
    list each), planes ordered (layer, K/V, head): mean, basis, steps; ``joint``: one plane per
    (layer, K/V) over all heads' channels, as the real kvtc fits."""
    planes = None
    for kv in kvs:
        heads = 1 if joint else kv[0].shape[1]
        if planes is None:
            planes = [[] for _ in range(len(kv) * heads)]
        for p, t in enumerate(kv):
            rows = t[0].double()  # [heads, tokens, dim]
            if joint:
                x = rows.permute(1, 0, 2)
                if p % 2 == 0:
                    x = turn(x, torch.arange(x.shape[0]), inv_freq, back=True)
                planes[p].append(x[SINK:].reshape(x.shape[0] - SINK, -1).numpy())
                continue
            for h in range(heads):
                x = rows[h]
                if p % 2 == 0:
                    x = turn(x, torch.arange(x.shape[0]), inv_freq, back=True)
                planes[p * heads + h].append(x[SINK:].numpy())
    fitted = [kvtc._fit_plane(np.concatenate(x)) for x in planes]
    weights = [(kvtc.KEY_WEIGHT if (i // heads) % 2 == 0 else 1.0) / max(f["variance"], 1e-30)
               for i, f in enumerate(fitted)]
    curves = [kvtc._plane_curve(f) for f in fitted]
    dim = fitted[0]["mean"].shape[0]  # the budget per token and plane: fp16 bits / ratio
    out = {}
    for ratio in ratios:
        steps = kvtc._allocate(fitted, curves, weights, dim * 16 * kvtc.UNITS / ratio)
        out[ratio] = [{"mean": torch.from_numpy(f["mean"]), "basis": torch.from_numpy(f["basis"]),
                       "step": torch.from_numpy(s)} for f, s in zip(fitted, steps)]
    return out


class Simulated:
    """Wraps ``kvzip.unpool``: every kept row an edited hit serves is coded and decoded by the
    simulated masked per-head kvtc at ``ratio`` (None: served exact); counts the estimated bits."""

    def __init__(self, planes, joint_planes, inv_freq, chunk):
        self.planes, self.joint_planes, self.inv_freq, self.chunk = planes, joint_planes, inv_freq, chunk
        self.joint = False  # code each token's heads together with the joint fit (unpruned only)
        self.fingerprint = None  # set: the served rows go through the real int4 codec instead (diagnostic)
        self.ratio, self.bits, self.values = None, 0.0, 0
        self.errors = {True: [], False: []}  # relative L2 error of each (layer, head)'s keys / values
        self.unpool = kvzip.unpool
        kvzip.unpool = self

    def __call__(self, parts, inv_freq=None):
        kv, held = self.unpool(parts, inv_freq)
        if self.ratio is None:
            return kv, held
        layers, heads, _ = parts[0][0].shape
        if self.fingerprint is not None:  # each head's kept rows in place (its own lane), int4-coded as a chunk
            m = kv[0].shape[2]
            coded = codecs.encode(_core.pack_chunk([t.contiguous() for t in kv], 0, m, self.fingerprint, bytes(16)),
                                  "int4")
            self.bits += 8 * len(coded)
            back = codecs.decode(coded)  # [layers, 2, m, heads, dim]
            for p, t in enumerate(kv):
                t[0] = back[p // 2, p % 2].permute(1, 0, 2).to(t.dtype)
            return kv, held
        if self.joint:
            n = int(held[0, 0])
            assert bool((held == n).all()), "the joint fit codes unpruned chunks only"
            positions = torch.arange(n)
            for p, t in enumerate(kv):
                x = t[0, :, :n].permute(1, 0, 2)  # [n, heads, dim]
                coded = self.code(x, positions, self.joint_planes[self.ratio][p], p % 2 == 0)
                t[0, :, :n] = coded.permute(1, 0, 2).to(t.dtype)
            return kv, held
        for layer in range(layers):
            for h in range(heads):
                positions = torch.cat([c * self.chunk + mask[layer, h].nonzero().flatten()
                                       for c, (mask, _) in enumerate(parts)])
                for part in (0, 1):
                    t = kv[2 * layer + part]
                    n = len(positions)
                    plane = self.planes[self.ratio][(2 * layer + part) * heads + h]
                    t[0, h, :n] = self.code(t[0, h, :n], positions, plane, part == 0).to(t.dtype)
        return kv, held

    def code(self, x, positions, plane, key):
        """Rows ``x`` (``[n, dim]``, or ``[n, heads, dim]`` for the joint fit) coded and decoded."""
        shape, x = x.shape, x.double()
        exact = positions < SINK
        y = (turn(x, positions, self.inv_freq, back=True) if key else x).reshape(len(x), -1)
        z = (y - plane["mean"]) @ plane["basis"].T
        live = plane["step"] > 0
        q = torch.zeros_like(z)
        q[:, live] = torch.clamp(torch.round(z[:, live] / plane["step"][live]), -127, 127)
        y_hat = ((q * plane["step"]) @ plane["basis"] + plane["mean"]).reshape(shape)
        x_hat = turn(y_hat, positions, self.inv_freq, back=False) if key else y_hat
        x_hat[exact] = x[exact]
        self.errors[key].append(float((x_hat - x).norm() / x.norm().clamp(min=1e-30)))
        coded = q[~exact][:, live].numpy().astype(np.int64) + 127
        if len(coded):
            self.bits += float(kvtc._entropy_bits(coded).sum()) * len(coded)
        self.bits += 16 * int(exact.sum()) * y.shape[1]
        self.values += x.numel()
        return x_hat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--records", type=int, default=5)
    parser.add_argument("--lines", type=int, default=100)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--configs", default="8:1,8:0.5,8:0.3,16:1,16:0.5,16:0.3", help="ratio:keep, ...")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", default="masked_kvtc.json")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load(args.model)
    configs = [(r if r == "int4" else int(r), float(k)) for r, k in (c.split(":") for c in args.configs.split(","))]
    keeps = sorted({k for _, k in configs}, reverse=True)
    inv_freq = model_inv_freq(model).double()
    records = line_records(args.records, args.lines, args.questions)
    calibration = [prompt_ids(tokenizer, c, "")[0].tolist() for c, _, _ in
                   line_records(2, args.lines, 1, skip=args.records)]
    ratios = sorted({r for r, _ in configs if r != "int4"})
    sim = Simulated({}, {}, inv_freq, KDNConfig().chunk_size)
    if ratios:
        t0 = time.perf_counter()
        with torch.inference_mode():
            kvs = [cache_to_kv_list(model(torch.tensor([ids]), use_cache=True).past_key_values) for ids in calibration]
        sim.planes, sim.joint_planes = fit_per_head(kvs, ratios, inv_freq), fit_per_head(kvs, ratios, inv_freq, True)
        del kvs
        kvtc.load(kvtc.calibrate(model, calibration, progress=False))  # the real codec, for the anchor row
        print(f"calibrations: {sum(map(len, calibration))} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    named = [("full", None, None, False)]
    if ratios:
        named += [(f"real kvtc:ratio={ratios[0]} (joint)", ratios[0], 1.0, False),
                  (f"sim kvtc:{ratios[0]} joint", ratios[0], 1.0, True)]
    named += [(f"sim kvtc-perhead:{r} x keep {k:g}" if r != "int4" else f"int4 after unpool x keep {k:g}", r, k,
               False) for r, k in configs]
    rows = {name: {"correct": {}, "bits": 0.0, "fp16_bits": 0.0} for name, *_ in named}
    for n, (context_text, questions, golds) in enumerate(records):
        prompts = [prompt_ids(tokenizer, context_text, q) for q in questions]
        context = shared_context(prompts)
        cache = KDN(KDNConfig(memory_bytes=8 << 30))
        cache.deposit(model, context, edits=[f"kvzip:keep={k:g}" for k in keeps if k < 1] + ["kvzip:keep=1"],
                      tokenizer=tokenizer)
        real = KDN(KDNConfig(memory_bytes=8 << 30, memory_codec=f"kvtc:ratio={ratios[0]}")) if ratios else None
        for key in cache.chunk_keys(model, context) if ratios else []:  # the exact chunks, coded by kvtc on put
            cache.engine.copy_to(real.engine, [key])
        layout = cache.session(model).layout
        for name, ratio, keep, joint in named:
            row = rows[name]
            for q, (p, gold) in enumerate(zip(prompts, golds)):
                sim.ratio = None if keep is None or name.startswith("real") else ratio
                sim.joint, sim.bits, sim.errors = joint, 0.0, {True: [], False: []}
                sim.fingerprint = cache.session(model).fingerprint if ratio == "int4" else None
                reader = real if name.startswith("real") else cache
                out = reader.generate(model, p, edits=None if sim.ratio is None else f"kvzip:keep={keep:g}", **gen)
                text = tokenizer.decode(out[0, p.shape[1]:], skip_special_tokens=True)
                row["correct"][f"{n}.{q}"] = float(gold in text)
                hit = reader.last_generate["hit_tokens"]
                if q == 0 and name.startswith("real"):
                    row["bits"] += 8 * sum(real.engine.stored_bytes(k) for k in real.chunk_keys(model, context))
                elif q == 0 and sim.ratio is not None:  # the stored document's bits: counted once per record
                    row["bits"] += sim.bits + hit * layout.layers * layout.kv_heads  # + the mask
                    row.setdefault("errors", []).append([float(np.mean(sim.errors[k])) for k in (True, False)])
                if q == 0:
                    row["fp16_bits"] += 16 * 2 * hit * layout.layers * layout.kv_heads * layout.head_dim
            print(f"record {n} {name}: {sum(row['correct'][f'{n}.{q}'] for q in range(len(prompts))):.0f}"
                  f"/{len(prompts)}", flush=True)
        summarize(rows, args.out)


def summarize(rows: dict, out: str) -> None:
    full = rows["full"]["correct"]
    table = {}
    for name, row in rows.items():
        scores = list(row["correct"].values())
        table[name] = {"questions": len(scores), "accuracy": sum(scores) / len(scores),
                       "accuracy_ci95": bootstrap_ci(scores),
                       "x_smaller_than_fp16": row["fp16_bits"] / row["bits"] if row["bits"] else None,
                       "vs_full": paired_difference(row["correct"], full) if name != "full" else None,
                       "key_value_rel_error": np.mean(row["errors"], 0).tolist() if row.get("errors") else None}
    Path(out).write_text(json.dumps({"rows": table, "answers": {k: v["correct"] for k, v in rows.items()}}, indent=1))
    for name, r in table.items():
        x = f"{r['x_smaller_than_fp16']:.1f}x" if r["x_smaller_than_fp16"] else "-"
        print(f"  {name:>28}: {r['accuracy']:.3f} {x} vs full {r['vs_full']} error {r['key_value_rel_error']}",
              flush=True)


if __name__ == "__main__":
    main()
