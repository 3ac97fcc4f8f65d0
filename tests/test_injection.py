"""The paper's table harness (benchmarks/bench_injection.py) on stories260K: each method ran over the
same questions (fine-tuning trained and its budgets were each judged, in-context learning and
KV-cache learning answered every question), KV-cache learning's answers are in-context learning's,
token for token, with the documents served from kdn, and the record's ratios and plot are written."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_three_ways_of_injecting_knowledge_each_answer_and_kv_answers_as_in_context_learning(tmp_path):
    import bench_injection

    data = Path(__file__).resolve().parent / "data"  # the slice a bare clone ships
    result = bench_injection.run("stories260k", 3, [2, 4], 512, 8, 4, 1e-3, 128, data_dir=data)
    icl, kv, ft = (result["methods"][m] for m in ("in-context learning", "KV-cache learning", "fine-tuning"))
    assert result["questions"] == 3 and all(len(m["questions"]) == 3 for m in (icl, kv, ft))
    assert result["same_answers_as_icl"] == 3  # exact reuse: the same tokens, every question
    assert all(a["tokens"] == b["tokens"] and len(a["tokens"]) > 0 for a, b in zip(icl["questions"], kv["questions"]))
    assert all(r["served_tokens"] >= 256 for r in kv["questions"])  # the documents came from kdn
    assert all(r["served_tokens"] == 0 for r in icl["questions"])
    assert kv["inject"]["wall_s"] > 0 and icl["inject"]["wall_s"] == 0
    assert [b["steps"] for b in ft["budgets"]] == [2, 4] and ft["budgets"][1]["inject"]["wall_s"] > \
        ft["budgets"][0]["inject"]["wall_s"] > 0  # trained, each budget's time the sum of its steps
    assert ft["windows"] > 0 and all(r["ttft_s"] > 0 for r in ft["questions"])
    measured = result["measured"]
    assert set(bench_injection.PAPER) <= set(measured) and measured["faster than in-context learning"]["ci95"][0] > 0
    bench_injection.cost_plot(result["methods"], tmp_path / "cost.png")
    assert (tmp_path / "cost.png").stat().st_size > 1000
