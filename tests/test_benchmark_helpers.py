"""The benchmarks' own logic (what a serving record says about its requests, when a headline run
starts), checked on inputs whose answer is known."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_serving  # noqa: E402
import serving_costs  # noqa: E402
from headline import BusyMachine, wait_for_quiet  # noqa: E402

DOC, CHUNK = 2000, 256


def test_a_hit_that_waited_for_its_documents_prefill_is_told_apart_from_a_hit_a_tier_served():
    """A request that starts while its document's first request is still prefilling waits for that prefill
    (kdn prefills a document once); only the hits that found their document stored measure a tier's
    hit, and ``hits_not_held`` holds those alone."""
    log = [{"doc": 0, "start": 0.0, "ttft": 10.0, "cached_tokens": 0},        # the miss
           {"doc": 0, "start": 3.0, "ttft": 7.5, "cached_tokens": 1984},      # held for it
           {"doc": 0, "start": 20.0, "ttft": 0.4, "cached_tokens": 1984},     # served from a tier
           {"doc": 1, "start": 1.0, "ttft": 0.6, "cached_tokens": 2000},      # doc 1 was stored before
           {"doc": 1, "start": 2.0, "error": "refused"},
           {"doc": 2, "start": 30.0, "ttft": 9.0, "cached_tokens": 1984},     # sent first, queued behind
           {"doc": 2, "start": 30.1, "ttft": 8.0, "cached_tokens": 0}]        # its document's miss
    served = serving_costs.by_served(log, DOC, CHUNK)
    assert (served["misses"]["count"], served["hits"]["count"], served["hits_not_held"]["count"]) == (2, 4, 2)
    assert served["hits"]["ttft_p99_s"] == 9.0 and served["hits_not_held"]["ttft_p99_s"] == 0.6
    assert serving_costs.held_hits(log, DOC, CHUNK) == {"hits": 4, "held": 2, "slow": 2, "slow_held": 2,
                                                         "longest_not_held_s": 0.6}


def test_a_headline_waits_for_a_quiet_machine_and_refuses_a_busy_one():
    """``headline.py`` starts a timing only when the load average has fallen to ``--max-load``; a machine
    that stays busier than that for ``--wait`` seconds is refused with the load named, not measured."""
    loads, slept = iter([3.0, 2.0, 1.2]), []
    assert wait_for_quiet(1.5, 60, load=lambda: next(loads), sleep=slept.append, poll_s=10) == 1.2
    assert slept == [10, 10]
    with pytest.raises(BusyMachine, match=r"load average 3\.00 > 1\.50 after 30 s"):
        wait_for_quiet(1.5, 30, load=lambda: 3.0, sleep=lambda s: None, poll_s=10)


def test_a_serving_table_without_the_prefix_cache_gives_no_ratio_to_it():
    """A run without vLLM's prefix cache (``serving-bf16``) prints "-" where the ratio to it would be, not a
    1.00 nobody measured; with it, each row's ratio is its throughput over the prefix cache's."""
    def row(config, rps, **extra):
        return {"config": config, "workload": "docqa", "n": 32, "concurrency": 4, "requests": 128,
                "throughput_rps": rps, "ttft_p50_s": 1.0 / rps, "ttft_p90_s": 1.0, "ttft_p99_s": 1.0,
                "hit_rate": 0.0, "kdn": {}, **extra}

    alone, kdn = row("vllm", 0.05), row("kdn-disk", 0.2, docs_prefilled=32)
    cells = bench_serving.table(bench_serving.bound([alone, kdn])).splitlines()[3].split(" | ")
    assert cells[11:14] == ["-", "-", "-"] and cells[14] == "100%"
    prefix = row("vllm-prefix", 0.1)
    rows = bench_serving.bound([row("vllm", 0.05), prefix, row("kdn-disk", 0.3, docs_prefilled=32)])
    assert [r["throughput_vs_prefix"] for r in rows] == [0.5, 1.0, pytest.approx(3.0)]
    # the prefix cache's 128 requests at 0.1 req/s over its 64 misses: at most 20 s a miss against vLLM alone's 25 s
    prefix["docs_prefilled"] = 64
    rows = bench_serving.bound([row("vllm", 0.04), prefix, row("kdn-disk", 0.3, docs_prefilled=32)])
    assert rows[2]["of_miss_bound"] == pytest.approx(0.3 / (0.04 * 4))
    assert rows[2]["of_miss_bound_prefix_priced"] == pytest.approx(0.3 * 32 * 20 / 128)


def test_a_capped_kdn_row_is_bounded_by_vllm_alone_under_the_same_cap():
    """``kdn-disk+lp64+prio``'s free-hit estimate is vLLM alone's with the same per-prefill cap (``vllm+lp64``: the
    cap slows every miss); the priority policy only orders requests, so it is no part of the match."""
    def row(config, rps, **extra):
        return {"config": config, "workload": "docqa", "n": 32, "concurrency": 4, "requests": 128,
                "throughput_rps": rps, **extra}

    rows = bench_serving.bound([row("vllm", 0.2), row("vllm+lp64", 0.1),
                                row("kdn-disk+lp64+prio", 0.35, docs_prefilled=32),
                                row("kdn-disk+prio", 0.7, docs_prefilled=32)])
    assert [r.get("miss_bound_rps") for r in rows[2:]] == [pytest.approx(0.4), pytest.approx(0.8)]


def test_a_replayed_run_keeps_the_median_and_the_spread():
    """``--replay K`` prices a hit by the median of K hits-only runs (one noisy replay moved the serial
    estimate 17%), keeps each run's throughput, and counts a document any replay prefilled."""
    runs = [{"throughput_rps": rps, "ttft_p50_s": 1 / rps, "ttft_p99_s": 2 / rps, "docs_prefilled": d, "wall_s": 40.0}
            for rps, d in ((3.3, 0), (2.8, 1), (3.0, 0))]
    replay = bench_serving.replayed(runs)
    assert replay["throughput_rps"] == 3.0 and replay["ttft_p50_s"] == 1 / 3.0
    assert replay["throughput_rps_each"] == [3.3, 2.8, 3.0]
    assert replay["docs_prefilled"] == 1 and replay["wall_s"] == 120
    row = {"config": "kdn-disk", "kdn": {}, "replay": replay, "of_hit_aware_bound": 0.95, "hit_aware_bound_rps": 0.6}
    assert "hits alone 3.000 req/s (of 3: 2.800-3.300): 95% of the serial estimate" in serving_costs.breakdown_line(row)


def test_chat_prefills_put_each_row_beside_the_floor_no_cache_goes_under():
    """Of 1,000 prompt tokens, kdn's hits (700) are 87.5% of the tokens that returned (800): the other 200 were
    new to every configuration; a row that served nothing prefilled all 1,000."""
    rows = [{"config": "vllm-prefix", "workload": "chat", "hit_rate": 0.0, "returning_served": 0.0, "kdn": {}},
            {"config": "kdn-disk", "workload": "chat", "hit_rate": 0.7, "returning_served": 0.875,
             "kdn": {"stored_tokens": 1000.0}}]
    assert serving_costs.chat_prefills(rows) == {"prompt": 1000.0, "floor": 200, "vllm-prefix": 1000, "kdn-disk": 300}


def test_an_editing_run_resumed_keeps_its_records_rescored_and_refuses_other_arguments(tmp_path, monkeypatch):
    """bench_editing --resume: what the JSON of a stopped run holds (its records' answers, rescored
    against the golds, stored bytes, TTFTs, deposits, full-prefill checks, provenance) comes back as the
    run had it; a run with other arguments is refused, not merged."""
    import bench_editing

    argv = ["bench_editing.py", "--task", "lines", "--records", "3", "--questions", "2", "--keeps", "0.5",
            "--codecs", "raw", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)  # what the record's command says
    args = bench_editing.arguments().parse_args(argv[1:])
    records = bench_editing.line_records(3, 100, 2)
    configs = [("raw", None), ("raw", bench_editing.parse("kvzip:keep=0.5").spec)]
    results = {c: {"answers": {}, "correct": {}, "ttft": [0.1, 0.3], "stored": 100 + i, "fp16": 400}
               for i, c in enumerate(configs)}
    for c in configs:
        for q in range(2):
            wrong = c[1] is not None and q == 1
            results[c]["answers"][f"0.{q}"] = "It is 12." if wrong else f"The number is {records[0][2][q]}."
            results[c]["correct"][f"0.{q}"] = 0.0 if wrong else 1.0
    deposit = {"tokens": 1700, "seconds": 90.0, "prefill_seconds": 30.0, "edit_seconds": {}}
    bench_editing.write_report(args, results, configs, ["raw"], records[:1], [deposit], [True])

    args.resume = True
    got, deposits, checks, done, runs = bench_editing.resumed(args, records, configs)
    assert got == results and deposits == [deposit] and checks == [True] and done == 1
    assert runs[0]["command"].endswith(" ".join(argv[1:]))
    other = bench_editing.arguments().parse_args([*argv[1:5], "--questions", "3", *argv[7:], "--resume"])
    with pytest.raises(SystemExit, match="questions"):
        bench_editing.resumed(other, records, configs)
    args.resume = False  # without --resume a run starts afresh
    assert bench_editing.resumed(args, records, configs)[3] == 0


def test_a_record_made_outside_a_checkout_names_the_commit_its_runner_gives(monkeypatch):
    """On a GPU machine kdn is an installed wheel with no .git beside it: the record names the
    commit ``$KDN_COMMIT`` gives (what ``.ci/gpu`` passes), and a checkout's own commit otherwise."""
    from kdn import info

    monkeypatch.setenv("KDN_COMMIT", "6bd3ed2")
    monkeypatch.setattr(info, "git_sha", lambda folder, exclude=None: "unknown")
    assert info.provenance()["git_sha"] == "6bd3ed2"
    monkeypatch.delenv("KDN_COMMIT")
    assert info.provenance()["git_sha"] == "unknown"
    monkeypatch.setenv("KDN_COMMIT", "6bd3ed2")
    monkeypatch.setattr(info, "git_sha", lambda folder, exclude=None: "abc123")
    monkeypatch.setattr(info, "kdn_checkout", lambda: Path("/src/kdn"))
    assert info.provenance()["git_sha"] == "abc123"


def test_an_installed_kdn_inside_another_repository_names_no_commit(tmp_path, monkeypatch):
    """pyenv is a git clone: a kdn installed into its site-packages found pyenv's commit and a
    MuSiQue record named it (f6a5b409, no commit of kdn's). Only a checkout's own layout
    (pyproject.toml beside python/kdn) gives a commit."""
    import importlib.util

    from kdn import info

    def git(folder, *args):
        subprocess.run(["git", *args], cwd=folder, check=True, capture_output=True)

    def load(path):
        path.parent.mkdir(parents=True)
        path.write_text(Path(info.__file__).read_text())
        spec = importlib.util.spec_from_file_location("info_copy", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    git(tmp_path, "init", "-q")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'kdn'\n")
    git(tmp_path, "add", "pyproject.toml")
    git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    installed = load(tmp_path / "lib" / "site-packages" / "kdn" / "info.py")
    monkeypatch.delenv("KDN_COMMIT", raising=False)
    assert installed.git_sha(tmp_path / "lib") == head  # what a record named before
    assert installed.kdn_checkout() is None and installed.checkout_sha() == "unknown"
    source = load(tmp_path / "python" / "kdn" / "info.py")
    assert source.kdn_checkout() == tmp_path.resolve() and source.checkout_sha().startswith(head)


def test_a_record_names_the_commit_its_run_started_at_and_any_that_landed_while_it_ran(monkeypatch):
    """A long benchmark imports its code when it starts: its record names that commit, and the one the
    checkout holds when the record is written only when commits landed meanwhile."""
    import timing

    monkeypatch.setattr(timing, "STARTED_AT", "459497b")
    monkeypatch.setattr(timing, "checkout_sha", lambda: "459497b")
    assert timing.run_info()["git_sha"] == "459497b" and "git_sha_at_save" not in timing.run_info()
    monkeypatch.setattr(timing, "checkout_sha", lambda: "eb26825+dirty")
    info = timing.run_info()
    assert info["git_sha"] == "459497b" and info["git_sha_at_save"] == "eb26825+dirty"


def test_a_coded_hit_wins_below_the_link_speed_where_its_decode_outweighs_the_bytes_it_saves():
    """``bench_gpu_load.coded_wins_below``: a load is its DMA (bytes over the link) plus what does not
    scale with the link; the crossover is where the bytes a codec saves take as long as its extra work."""
    from bench_gpu_load import coded_wins_below

    raw_bytes, coded_bytes = 2_000_000_000, 500_000_000
    link = 50e9  # the measured DMAs below are these bytes at 50 GB/s
    wins = coded_wins_below(0.040 + raw_bytes / link, raw_bytes / link, raw_bytes,
                            0.070 + coded_bytes / link, coded_bytes / link, coded_bytes)
    assert wins == pytest.approx((raw_bytes - coded_bytes) / 0.030 / 1e9)  # 50 GB/s: a tie on this very link
    for speed, coded_faster in ((wins * 0.9, True), (wins * 1.1, False)):
        raw_s, coded_s = 0.040 + raw_bytes / (speed * 1e9), 0.070 + coded_bytes / (speed * 1e9)
        assert (coded_s < raw_s) == coded_faster
    assert coded_wins_below(0.080, 0.040, raw_bytes, 0.050, 0.020, coded_bytes) == float("inf")  # less work too


def test_a_gpu_run_tells_a_near_tie_from_other_tokens():
    """``gpu_vllm.agreement``: where a served engine's greedy tokens first differ from vLLM alone's, a
    bf16 near-tie (vLLM alone's two best within TIE nats, the engine took the second) is not wrong KV;
    anything else is "DIFFERENT"."""
    from gpu_vllm import TIE, agreement

    best = [[5, -1.0], [6, -1.0 - TIE / 2]]
    reference = {"results": [{"tokens": [1, 5, 7], "logprobs": [[[1, -0.1]], best, [[7, -0.2]]]},
                             {"tokens": [1, 5], "logprobs": [[[1, -0.1]], [[5, -1.0], [6, -3.0]]]}]}
    served = {"results": [{"tokens": [1, 6, 9]}, {"tokens": [1, 6]}]}
    assert agreement(reference, served) == [f"tie at 1 (margin {TIE / 2:.3f})", "DIFFERENT at 1"]
    assert agreement(reference, reference) == ["same", "same"]
    assert agreement(reference, {"error": "no answer"}) is None
