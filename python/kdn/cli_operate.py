"""The operator's commands of the ``kdn`` CLI over a store another process wrote: ``kdn stats`` (per
tier), ``kdn ls`` (the prompts a model has stored) and ``kdn evict`` (by text, file, token ids or
age, or all of a tenant's), each with ``--json``; the work is :mod:`kdn.operate`'s. Through a running
engine's admin endpoint (:mod:`kdn.admin`): ``kdn pin`` / ``kdn unpin`` a stored prompt, and ``kdn
warm`` (documents deposited, then pinned). Exit 0 on success, 1 when nothing matched, 2 when the
store or the arguments cannot be used (one line on stderr)."""

from __future__ import annotations

import json
import sys

COMMANDS = ("stats", "ls", "evict")


def add_parsers(sub) -> None:
    """The three commands' parsers on ``sub`` (the CLI's subparsers)."""
    store = "a disk or node tier's folder, or a remote store URL (redis://host:port/db, mooncake://...)"
    stats = sub.add_parser("stats", help="what a store holds, per tier: entries, bytes, hits, misses, ages")
    stats.add_argument("store", help=store)
    stats.add_argument("--model", default=None, help="also what this tenant holds of the model: prompts, chunks, "
                                                     "bytes")
    stats.add_argument("--dtype", default=None, choices=[None, "float32", "float16", "bfloat16"])
    listing = sub.add_parser("ls", help="the prompts a model has stored (rebuilt from their chunks' pointers)")
    evict = sub.add_parser("evict", help="remove stored prompts by text, file, token ids or age (a prefix other "
                                         "stored prompts share stays)")
    for p in (listing, evict):
        p.add_argument("store", help=store)
        p.add_argument("--model", required=True, help="smollm2-135m, stories260k, qwen2.5-coder-*, or an HF folder")
        p.add_argument("--dtype", default=None, choices=[None, "float32", "float16", "bfloat16"])
    for p in (stats, listing, evict):
        p.add_argument("--chunk-size", type=int, default=256, help="the chunk size the store was written with")
        p.add_argument("--json", action="store_true", help="print JSON (one object) instead of text")
    which = evict.add_mutually_exclusive_group(required=True)
    which.add_argument("--text", help="the text the prompts to remove begin with (a document), as the model's "
                                      "tokenizer splits it")
    which.add_argument("--file", help="a file holding the prompt's text")
    which.add_argument("--tokens", help="the prompt's token ids, comma-separated")
    which.add_argument("--older-than", type=float, metavar="SECONDS",
                       help="every stored prompt whose newest chunk file is older (folder tiers)")
    which.add_argument("--all", action="store_true",
                       help="every prompt this tenant stored (KDN_NAMESPACE / KDN_SECRET name it; another "
                            "tenant's keys derive from its own secret and are never reached)")


def add_pin_parsers(sub) -> None:
    """``kdn pin`` / ``kdn unpin``: a stored prompt kept in (or let out of) a running engine's memory
    through its admin endpoint (a pin lives in the process that serves)."""
    for name, what in (("pin", "keep a stored prompt in a running engine's memory (its admin endpoint)"),
                       ("unpin", "let a pinned prompt be evicted again (a running engine's admin endpoint)")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--admin", required=True, help="the engine's admin endpoint: http://host:port or unix:/path")
        p.add_argument("--admin-token", default=None, help="its bearer token (default: $KDN_ADMIN_TOKEN)")
        p.add_argument("--model", default=None, help="the model whose tokenizer splits --text / --file")
        p.add_argument("--dtype", default=None, choices=[None, "float32", "float16", "bfloat16"])
        p.add_argument("--json", action="store_true", help="print JSON (one object) instead of text")
        if name == "pin":
            p.add_argument("--seconds", type=float, required=True, help="how long it stays pinned")
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument("--text", help="the prompt's text (with --model)")
        which.add_argument("--file", help="a file holding the prompt's text (with --model)")
        which.add_argument("--tokens", help="the prompt's token ids, comma-separated")


def pin(args, open_model) -> int:
    """``kdn pin`` / ``kdn unpin``: 0 when some chunk was pinned (unpinned), 1 when the engine holds
    none of the prompt, 2 on bad arguments or a refusal (over the operator's bound, a wrong token)."""
    import os

    from kdn._core import KDNError
    from kdn.admin import ask

    try:
        if args.tokens is None and args.model is None:
            raise KDNError("--text and --file need --model (its tokenizer splits the text)")
        tokenizer = None if args.tokens is not None else open_model(args.model, args.dtype)[1]
        body = {"tokens": _prompt_tokens(args, tokenizer)}
        if args.command == "pin":
            body["seconds"] = args.seconds
        out = ask(args.admin, f"/v1/{args.command}", body, args.admin_token or os.environ.get("KDN_ADMIN_TOKEN"))
    except (KDNError, OSError, ValueError) as e:
        print(f"kdn {args.command}: {e}", file=sys.stderr)
        return 2
    chunks = next(iter(out.values()))
    _print(args, out, lambda o: f"{chunks} chunks {args.command}ned")
    return 0 if chunks else 1


def add_warm_arguments(warm) -> None:
    """``kdn warm``'s own arguments (the rest are ``kdn deposit``'s)."""
    warm.add_argument("--admin", required=True, help="the running engine's admin endpoint: http://host:port or "
                                                     "unix:/path (kv_connector_extra_config admin)")
    warm.add_argument("--seconds", type=float, required=True, help="how long each document stays pinned in memory")
    warm.add_argument("--admin-token", default=None, help="its bearer token (default: $KDN_ADMIN_TOKEN)")


def warm(args, deposit, open_model) -> int:
    """``kdn warm``: ``deposit(args)`` (``kdn deposit``: resumable, stored documents skipped), then each
    document pinned for ``--seconds`` through the admin endpoint of the engine that serves the store.
    0 when every document is pinned, 1 when the engine holds some not (it reads another store?), 2
    on bad arguments, an unusable store or a refused pin (one line on stderr)."""
    import os

    from tqdm import tqdm

    from kdn._core import KDNError
    from kdn.admin import ask
    from kdn.edits.batch import documents

    code = deposit(args)
    if code != 0:
        return code
    token = args.admin_token or os.environ.get("KDN_ADMIN_TOKEN")
    try:
        _, tokenizer = open_model(args.model, args.dtype)
        pinned = {name: ask(args.admin, "/v1/pin", {"tokens": list(tokenizer(text)["input_ids"]),
                                                    "seconds": args.seconds}, token)["pinned_chunks"]
                  for name, text, _ in tqdm(documents(args.source), desc="pinning", unit="doc")}
    except KDNError as e:
        print(f"kdn warm: {e}", file=sys.stderr)
        return 2
    missing = sorted(name for name, chunks in pinned.items() if chunks == 0)
    print(f"{len(pinned) - len(missing)} documents pinned for {args.seconds:g} s ({sum(pinned.values())} chunks)"
          + (f"; not held by the engine: {', '.join(map(str, missing))}" if missing else ""))
    return 1 if missing else 0


def run(args, store_config, open_model) -> int:
    """Run ``kdn stats`` / ``ls`` / ``evict`` as parsed by :func:`add_parsers`, with the CLI's own
    ways of opening a store and a model (:func:`kdn.cli.store_config`, :func:`kdn.cli.open_model`:
    passed in, so that this room does not import the CLI back)."""
    from kdn import KDN, operate
    from kdn._core import KDNError

    def fail(message: str) -> int:
        print(f"kdn {args.command}: {message}", file=sys.stderr)
        return 2

    try:
        cache = KDN(store_config(args.store, args.chunk_size))  # a read-only folder still removes
    except KDNError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001 - an unreachable store (connection refused, auth, timeout)
        return fail(f"cannot read {args.store}: {type(e).__name__}: {e}")
    if args.command == "stats":
        out = operate.stats(cache)
        if args.model is not None:
            try:
                out["tenant"] = operate.tenant_usage(cache, open_model(args.model, args.dtype)[0])
            except KDNError as e:
                return fail(str(e))
        return _print(args, out, _stats_text)
    try:
        model, tokenizer = open_model(args.model, args.dtype)
    except KDNError as e:
        return fail(str(e))
    rows = operate.listing(cache, model, tokenizer)
    if args.command == "ls":
        return _print(args, {"prompts": rows}, _listing_text)
    if args.all:
        chosen = [r["token_ids"] for r in rows]
    elif args.older_than is not None:
        chosen = [r["token_ids"] for r in rows if r["age_seconds"] is not None and r["age_seconds"] > args.older_than]
    else:
        try:
            given = _prompt_tokens(args, tokenizer)
        except (OSError, ValueError) as e:
            return fail(str(e))
        # the stored prompts that begin with it (a document and the questions asked after it) or that it
        # begins with (the stored part of it), else itself
        chosen = [r["token_ids"] for r in rows if r["token_ids"][:len(given)] == given[:len(r["token_ids"])]]
        chosen = chosen or [given]
    kept = [r["token_ids"] for r in rows if r["token_ids"] not in chosen]
    removed = operate.evict(cache, model, chosen, kept)
    cache.flush()
    code = _print(args, {"prompts": len(chosen), "chunks_removed": removed},
                  lambda out: f"{out['chunks_removed']} chunks of {out['prompts']} prompts removed")
    return code if removed else 1


def _prompt_tokens(args, tokenizer) -> list[int]:
    if args.tokens is not None:
        return [int(t) for t in args.tokens.split(",") if t.strip()]
    text = args.text if args.text is not None else open(args.file, encoding="utf-8").read()
    return tokenizer(text)["input_ids"]


def _print(args, out, as_text) -> int:
    print(json.dumps(out, indent=1) if args.json else as_text(out))
    return 0


def _stats_text(out: dict) -> str:
    lines = []
    for tier, row in out.items():
        if tier == "tenant":
            lines.append(f"tenant {row['namespace'] or '(default)'}: {row['prompts']} prompts, {row['chunks']} chunks, "
                         f"{row['bytes'] / 2**20:.1f} MiB")
            continue
        ages = (f", files {row['newest_seconds']:.0f}-{row['oldest_seconds']:.0f} s old"
                if "oldest_seconds" in row else "")
        lines.append(f"{tier}: {row['entries']} entries, {row.get('used_bytes', 0) / 2**20:.1f} MiB{ages}")
    return "\n".join(lines) or "no lasting tier"


def _listing_text(out: dict) -> str:
    lines = [f"{len(out['prompts'])} stored prompts"]
    for row in out["prompts"]:
        age = f", {row['age_seconds']:.0f} s old" if row["age_seconds"] is not None else ""
        lines.append(f"  {row['tokens']:>7} tokens ({row['served']} served, {row['chunks']} chunks, "
                     f"{'+'.join(row['tiers'])}{age}) {row.get('text', '')!r}")
    return "\n".join(lines)
