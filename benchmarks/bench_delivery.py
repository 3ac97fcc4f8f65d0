"""Delivery over a real shaped link: full prefill vs a remote hit delivered whole (today's path),
layer-wise, and adaptive (levels picked per layer group for a TTFT deadline, text fallback); fixed
links and CacheGen's bandwidth traces replayed with tc while requests run. SmolLM2-135M, fp32.

Usage: python benchmarks/bench_delivery.py [--lengths 4096,8192] [--links 0.1,0.5,1,10] [--repeats 2]
       [--trace-requests 20] [--deadline 1.0,2.0] [--out bench_out/delivery]
Needs root (network namespaces, tc), redis-server and iproute2. Prints tables with ratios and
writes bench_delivery_<lengths>.json / .md / .png under --out (after each length).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LADDER = ("int8", "int4", "cachegen:level=2", "cachegen:level=1")  # below the exact (raw) level
QUESTION = "\nQuestion: Which harbour does the archive describe first, and who kept its records?\nAnswer:"
CHUNK = 256
CONTINUATION = 16


def context_ids(tokenizer, n: int) -> list[int]:
    text = (Path(__import__("kdn").__file__).parent / "data" / "velmora.txt").read_text()
    ids = tokenizer(text).input_ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def distributions(model, ids: torch.Tensor, cache, continuation: torch.Tensor):
    """Log-probabilities at the prompt's last position and along ``continuation`` (teacher-forced)."""
    first = model(ids, past_key_values=cache, use_cache=True)
    rest = model(continuation[:, :-1], past_key_values=first.past_key_values).logits[0]
    return torch.cat([first.logits[0, -1:], rest]).log_softmax(-1)


def quality(reference: torch.Tensor, served: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || served) in nats, greedy agreement) over the positions."""
    kl = (reference.exp() * (reference - served)).sum(-1).mean().item()
    return kl, (reference.argmax(-1) == served.argmax(-1)).float().mean().item()


class Bench:
    def __init__(self, model, link, estimates_for):
        self.model, self.link, self.estimates_for = model, link, estimates_for

    def reader(self, method: str, deadline: float | None):
        from kdn import KDN, KDNConfig

        base = dict(chunk_size=CHUNK, remote_url=self.link.url, remote_timeout=30.0)
        if method == "whole":
            config = KDNConfig(delivery="whole", **base)
        elif method == "layerwise":
            config = KDNConfig(**base)
        elif method == "adaptive":
            config = KDNConfig(ttft_deadline=deadline, delivery_levels=LADDER, **base)
        else:  # a fixed level: the remote copy in that codec, streamed layer-wise
            config = KDNConfig(remote_codec=method, **base)
        kdn = KDN(config)
        kdn.engine.estimates = self.estimates_for(method)
        return kdn

    def request(self, method: str, ids: torch.Tensor, ref, continuation, deadline=None) -> dict:
        """One request from a new process-like reader (empty memory): TTFT, quality, bytes."""
        from kdn.delivery import DeliveryError

        kdn = self.reader(method, deadline)
        n = ids.shape[1]
        started = time.perf_counter()
        cache, hit = kdn.retrieve(self.model, ids, limit=n - 1)
        try:
            first = self.model(ids[:, hit:], past_key_values=cache, use_cache=True)
        except DeliveryError:  # what generate does: recompute the prompt (counted, and in the TTFT)
            hit, failed = 0, True
            first = self.model(ids, use_cache=True)
        else:
            failed = False
        ttft = time.perf_counter() - started
        stream = kdn.last_retrieve["stream"]
        stats = dict(stream.stats) if stream is not None else {}
        if method == "whole":
            stats["bytes"] = hit and kdn.memory.used_bytes  # the exact chunks, promoted whole
        rest = self.model(continuation[:, :-1], past_key_values=first.past_key_values).logits[0]
        served = torch.cat([first.logits[0, -1:], rest]).log_softmax(-1)
        kl, agree = quality(ref, served)
        kdn.memory.clear()  # (clear() would empty the remote store too)
        return {"ttft": ttft, "hit": hit, "failed": failed, "kl": kl, "agreement": agree,
                "bytes": stats.get("bytes", 0),
                "levels": stats.get("levels"), "recomputed_chunks": stats.get("recomputed_chunks", 0),
                "fetch_seconds": stats.get("fetch_seconds"), "decode_seconds": stats.get("decode_seconds")}


def stages(bench, ids: torch.Tensor) -> dict:
    """The whole path's stages measured apart: transfer (remote reads), decode + layout, compute."""
    from kdn import _core
    from kdn.engine.layout import empty_kv_list
    from kdn.layout import kv_list_to_cache

    kdn = bench.reader("whole", None)
    session = kdn.session(bench.model)
    found = kdn.engine.find(session, session.tokens(ids), ids.shape[1] - 1)
    t0 = time.perf_counter()
    blobs = kdn.remote.get_many(found.keys)
    t1 = time.perf_counter()
    kv = empty_kv_list(session.layout, found.tokens)
    _core.unpack_chunks(blobs, kv, found.tokens)
    t2 = time.perf_counter()
    bench.model(ids[:, found.tokens:], past_key_values=kv_list_to_cache(bench.model, kv))
    t3 = time.perf_counter()
    kdn.memory.clear()
    return {"transfer": t1 - t0, "decode": t2 - t1, "compute": t3 - t2}


def summarize(rows: list[dict], deadline: float | None = None) -> dict:
    ttfts = sorted(r["ttft"] for r in rows)
    out = {"ttft_mean": statistics.mean(ttfts), "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
           "kl": statistics.mean(r["kl"] for r in rows), "agreement": statistics.mean(r["agreement"] for r in rows),
           "mbytes": statistics.mean(r["bytes"] for r in rows) / 1e6, "requests": len(rows),
           "failed": sum(r["failed"] for r in rows)}
    if deadline is not None:
        out["met"] = sum(r["ttft"] <= deadline for r in rows) / len(rows)
    return out


def replay(link, trace: list[float], interval: float, stop: threading.Event) -> None:
    for gbps in trace:
        link.set_rate(gbps)
        if stop.wait(interval):
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--links", default="0.1,0.5,1,10", help="fixed link rates, Gbit/s ('' for none)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trace-requests", type=int, default=20)
    parser.add_argument("--trace-methods", default="adaptive,raw," + ",".join(LADDER))
    parser.add_argument("--interval", type=float, default=0.25, help="seconds per trace value")
    parser.add_argument("--trace-scale", type=float, default=1.0,
                        help="multiply the traces' rates (this host's loopback tops out near 2.5 Gbit/s)")
    parser.add_argument("--deadline", default="", help="TTFT deadline per length, seconds (default: measured)")
    parser.add_argument("--out", default="bench_out/delivery")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kdn
    from kdn import KDN, KDNConfig
    from kdn.delivery import Estimates
    from shaped_link import ShapedRedis, link_unavailable

    why = link_unavailable()
    if why:
        sys.exit(f"bench_delivery: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still removes its namespace
    shared = os.environ.get("KDN_SHARED") or str(ROOT.parent / "shared")
    traces = [[gbps * args.trace_scale for gbps in json.loads(line)["bw"]]
              for line in (Path(shared) / "data/CacheGen/bw.jsonl").read_text().splitlines()]
    torch.set_grad_enabled(False)
    model, tokenizer = kdn.models.load("smollm2-135m")
    lengths = [int(x) for x in args.lengths.split(",")]
    deadlines = [float(x) for x in args.deadline.split(",")] if args.deadline else [None] * len(lengths)
    link = ShapedRedis(Path(args.out) / "redis", gbps=10.0)
    estimates: dict[str, Estimates] = {}
    bench = Bench(model, link, lambda method: estimates.setdefault(method, Estimates()))
    results = {"ladder": ["raw", *LADDER], "trace_scale": args.trace_scale, "interval": args.interval, "lengths": {}}
    try:
        for n, deadline in zip(lengths, deadlines):
            estimates.clear()
            ids = torch.tensor([context_ids(tokenizer, n) + tokenizer(QUESTION).input_ids])
            context = ids[:, :n]
            t0 = time.perf_counter()
            writer = KDN(KDNConfig(chunk_size=CHUNK, remote_url=link.url, delivery_levels=LADDER,
                                   remote_queue_bytes="4GiB"))  # the whole context queued at once
            writer.remote.clear()
            writer.store(model, context, model(context, use_cache=True).past_key_values)
            writer.flush()
            print(f"\n{n} tokens: stored at {1 + len(LADDER)} levels in {time.perf_counter() - t0:.1f} s")
            writer.memory.clear()  # the remote store keeps every level
            ref_out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CONTINUATION,
                                     do_sample=False)
            continuation = ref_out[:, ids.shape[1]:]
            ref = distributions(model, ids, None, continuation)
            prefill_s = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                model(ids, use_cache=True)
                prefill_s.append(time.perf_counter() - t0)
            full = statistics.median(prefill_s)
            for method in ("adaptive", "layerwise", "whole", *LADDER):
                bench.estimates_for(method).observe_prefill(writer.session(model).fingerprint, ids.shape[1], full)
            deadline = deadline or round(0.25 * full, 2)
            print(f"full prefill {full:.2f} s; deadline {deadline:.2f} s")
            entry = {"full_prefill": full, "deadline": deadline, "links": {}, "traces": {}}
            for gbps in [float(x) for x in args.links.split(",") if x]:
                link.set_rate(gbps)
                row = {"stages": stages(bench, ids)}
                for method in ("adaptive", "layerwise", "whole", *LADDER):  # a hit's forward, as a server sees it
                    bench.estimates_for(method).observe_prefill(writer.session(model).fingerprint,
                                                                ids.shape[1] - n, row["stages"]["compute"])
                for method in ("whole", "layerwise", "adaptive"):
                    row[method] = summarize([bench.request(method, ids, ref, continuation, deadline)
                                             for _ in range(args.repeats)], deadline)
                entry["links"][str(gbps)] = row
                st = row["stages"]
                print(f"  {gbps:>5} Gbps  transfer {st['transfer']:.2f} s decode {st['decode']:.2f} s compute "
                      f"{st['compute']:.2f} s | whole {row['whole']['ttft_mean']:.2f} s  layerwise "
                      f"{row['layerwise']['ttft_mean']:.2f} s ({row['layerwise']['ttft_mean'] / max(st.values()):.2f}x "
                      f"max stage)  adaptive {row['adaptive']['ttft_mean']:.2f} s (KL {row['adaptive']['kl']:.4f})"
                      f"  full prefill {full:.2f} s")
            for method in args.trace_methods.split(",") if args.trace_requests else []:  # 0: fixed links only
                rows = []
                for i in range(args.trace_requests):
                    trace = traces[i % len(traces)]
                    schedule = trace[(i // len(traces)) * 3:] + trace[: (i // len(traces)) * 3]
                    link.set_rate(schedule[0])
                    stop = threading.Event()
                    player = threading.Thread(target=replay, args=(link, schedule, args.interval, stop))
                    player.start()
                    try:
                        name = "layerwise" if method == "raw" else method
                        rows.append(bench.request(name, ids, ref, continuation, deadline))
                    finally:
                        stop.set()
                        player.join()
                entry["traces"][method] = summarize(rows, deadline)
                s = entry["traces"][method]
                print(f"  traces {method:>18}: TTFT mean {s['ttft_mean']:.2f} p90 {s['ttft_p90']:.2f} s, "
                      f"met {s['met']:.0%}, KL {s['kl']:.4f}, agreement {s['agreement']:.3f}, {s['mbytes']:.1f} MB")
            results["lengths"][str(n)] = entry
            write(results, Path(args.out))  # after each length: a later failure keeps what was measured
    finally:
        link.stop()


def write(results: dict, out: Path) -> None:
    from timing import save_result

    name = "bench_delivery_" + "_".join(results["lengths"])
    save_result(out / f"{name}.json", results)
    (out / f"{name}.md").write_text(markdown(results))
    plot(results, out / f"{name}.png")
    print(f"wrote {out / name}.json, .md, .png")


def markdown(results: dict) -> str:
    lines = []
    for n, e in results["lengths"].items():
        lines += [f"\n### {n} tokens: full prefill {e['full_prefill']:.2f} s, deadline {e['deadline']:.2f} s\n",
                  "| link Gbps | transfer s | decode s | compute s | whole TTFT s | layer-wise TTFT s | layer-wise / "
                  "max stage | adaptive TTFT s (p90) | adaptive KL | adaptive agreement | MB whole / layer-wise / "
                  "adaptive | full prefill / adaptive |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for gbps, row in e["links"].items():
            st, w, lw, ad = row["stages"], row["whole"], row["layerwise"], row["adaptive"]
            lines.append(f"| {gbps} | {st['transfer']:.2f} | {st['decode']:.2f} | {st['compute']:.2f} | "
                         f"{w['ttft_mean']:.2f} | {lw['ttft_mean']:.2f} | {lw['ttft_mean'] / max(st.values()):.2f} | "
                         f"{ad['ttft_mean']:.2f} ({ad['ttft_p90']:.2f}) | {ad['kl']:.4f} | {ad['agreement']:.3f} | "
                         f"{w['mbytes']:.0f} / {lw['mbytes']:.0f} / {ad['mbytes']:.0f} | "
                         f"{e['full_prefill'] / ad['ttft_mean']:.1f}x |")
        lines += ["", "| traces: level | TTFT mean s | p90 s | met deadline | KL | agreement | MB moved |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for method, s in e["traces"].items():
            lines.append(f"| {method} | {s['ttft_mean']:.2f} | {s['ttft_p90']:.2f} | {s['met']:.0%} | {s['kl']:.4f} | "
                         f"{s['agreement']:.3f} | {s['mbytes']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(results["lengths"].items())
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4), squeeze=False)
    for ax, (n, e) in zip(axes[0], lengths):
        links = list(e["links"])
        for method in ("whole", "layerwise", "adaptive"):
            ax.plot([float(g) for g in links], [e["links"][g][method]["ttft_mean"] for g in links], "o-", label=method)
        ax.axhline(e["full_prefill"], color="gray", ls="--", label="full prefill")
        ax.axhline(e["deadline"], color="red", ls=":", label="deadline")
        ax.set(xscale="log", yscale="log", xlabel="link (Gbit/s)", ylabel="TTFT (s)", title=f"SmolLM2, {n} tokens")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
