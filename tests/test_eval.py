"""Evaluation harness: metrics on hand-made cases, dataset loaders on the real files, and small runs
on stories260K / SmolLM2 asserting that `reuse` answers exactly like `full`."""

import csv
import json

import pytest
import torch

from kdn.cli import main as cli_main
from kdn.eval import (
    DatasetNotFoundError,
    encode,
    line_accuracy,
    load_dataset,
    normalize_answer,
    qa_f1,
    run_eval,
    topic_accuracy,
)
from kdn.eval.report import load_jsonl, save_jsonl

pytestmark = pytest.mark.eval


@pytest.mark.parametrize("text, expected", [("The  Eiffel-Tower!", "eiffeltower"), ("An apple a day", "apple day"),
                                            ("  Exeter College. ", "exeter college"), ("the", "")])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_qa_f1_takes_the_best_gold_answer():
    assert qa_f1("Exeter College", ["Exeter College"]) == 1.0
    assert qa_f1("He studied at Exeter College, Oxford", ["Exeter College"]) == pytest.approx(0.5)  # P 2/6, R 1
    assert qa_f1("Oxford", ["Cambridge", "University of Oxford"]) == pytest.approx(2 * 1 * (1 / 3) / (1 + 1 / 3))
    assert qa_f1("", ["x"]) == 0.0 and qa_f1("the a an", ["the"]) == 0.0


def test_topic_and_line_accuracy():
    assert topic_accuracy("The first topic was the psychology of creativity.", "The psychology of creativity") == 1.0
    assert topic_accuracy("Psychology of addiction", "The psychology of creativity") == 0.0
    assert line_accuracy("The REGISTER_CONTENT in line torpid-kid is <2416>.", 2416) == 1.0
    assert line_accuracy("2416 ... no, 2417", "2416") == 0.0 and line_accuracy("no number", 1) == 0.0


def test_dataset_slices_load_with_their_gold_answers():
    """tests/data: the first records of each dataset kind, so a bare clone runs the evaluation tests."""
    assert [len(load_dataset(name)) for name in ("longchat-topics-5", "longchat-lines-200", "cachegen-longchat",
                                                   "musique")] == [3, 3, 3, 3]
    assert load_dataset("musique")[0].answers == ("Exeter College",)
    assert load_dataset("longchat-lines-200")[0].answers == ("2416",)


def test_full_datasets_load_with_their_gold_answers(full_data):
    topics = load_dataset("longchat-topics-5", data_dir=full_data)
    assert len(topics) == 50 and topics[0].answers == ("The psychology of creativity",)
    assert topics[0].query.strip().startswith("Now the record ends. What is the first topic")
    assert "I would like to discuss the topic of the psychology of creativity" in topics[0].segments[0]
    lines = load_dataset("longchat-lines-200", data_dir=full_data)
    assert len(lines) == 50 and lines[0].answers == ("2416",) and "torpid-kid" in lines[0].query
    cachegen = load_dataset("cachegen-longchat", limit=3, data_dir=full_data)
    assert len(cachegen) == 3 and not cachegen[0].query.rstrip().endswith("ASSISTANT:")
    musique = load_dataset("musique", data_dir=full_data)
    assert len(musique) == 150 and len(musique[0].segments) == 10 and musique[0].answers == ("Exeter College",)
    assert "Hannibal and Scipio" in musique[0].query and musique[0].metric == "qa_f1"
    with pytest.raises(ValueError, match="known names"):
        load_dataset("no-such-set")


def test_a_missing_dataset_names_where_it_looked(tmp_path, capsys):
    with pytest.raises(DatasetNotFoundError, match=f"looked in: {tmp_path}"):
        load_dataset("musique", data_dir=tmp_path)
    assert cli_main(["eval", "musique", "--model", "stories260k", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "CacheBlend" / "musique_s.json") in err
    assert "Traceback" not in err


def test_encode_keeps_segment_spans_and_truncates_the_context(stories):
    model, tokenizer = stories
    sample = load_dataset("musique", limit=1)[0]
    enc = encode(tokenizer, sample, max_prompt_tokens=1 << 20, max_new_tokens=8)
    assert not enc.truncated and len(enc.segment_spans) == 10
    assert enc.segment_spans[-1][1] == enc.context_tokens < enc.ids.shape[1]
    query_ids = tokenizer(sample.query, add_special_tokens=False)["input_ids"]
    assert enc.ids[0, enc.context_tokens:].tolist() == query_ids
    short = encode(tokenizer, sample, max_prompt_tokens=300, max_new_tokens=8)
    assert short.truncated and short.ids.shape[1] == 300 - 8


@pytest.mark.parametrize("dataset", ["longchat-topics-5", "cachegen-longchat", "longchat-lines-200", "musique"])
def test_reuse_answers_exactly_like_full_on_stories260k(stories, dataset, tmp_path):
    model, tokenizer = stories
    methods = ["full", "reuse", "reuse+int8", "naive", "blend@0.15"]
    result = run_eval(dataset, model, tokenizer, methods, limit=2, out_dir=tmp_path, max_new_tokens=8,
                      chunk_size=64, model_name="stories260k", progress=False)
    summary = result["summary"]
    assert summary["reuse"]["identical_to_full"] == 1.0
    for name in ("full", "reuse"):
        s = summary[name]
        assert s["n"] == 2 and 0.0 <= s["quality"] <= 1.0 and s["ttft_mean_s"] > 0
    assert summary["reuse"]["prefill_tokens_mean"] < summary["full"]["prefill_tokens_mean"]
    assert summary["reuse"]["inject_s_mean"] > 0 and summary["reuse"]["stored_bytes_mean"] > 0
    # int8 KV: a quarter of fp32 in bytes (plus scales), nearly the same answers
    assert summary["reuse+int8"]["available"] and summary["reuse+int8"]["n"] == 2
    assert summary["reuse+int8"]["stored_bytes_mean"] < 0.35 * summary["reuse"]["stored_bytes_mean"]
    assert summary["reuse+int8"]["prefill_tokens_mean"] == summary["reuse"]["prefill_tokens_mean"]
    for name in ("naive", "blend@0.15"):  # segments cached separately: fewer tokens computed than full
        assert summary[name]["n"] == 2 and summary[name]["prefill_tokens_mean"] < summary["full"]["prefill_tokens_mean"]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(methods) and all("score" in r for r in rows if r["available"])
    with open(tmp_path / "summary.csv") as f:
        assert [r["method"] for r in csv.DictReader(f)] == methods
    md = (tmp_path / "summary.md").read_text()
    assert all(f"| {m} |" in md for m in methods) and "time to inject" in md
    assert (tmp_path / "quality_vs_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["summary"]["reuse"]["available"]


def test_unknown_method_is_a_clear_error(stories):
    model, tokenizer = stories
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        run_eval("musique", model, tokenizer, ["magic"], limit=1, progress=False)
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        run_eval("musique", model, tokenizer, ["reuse+zip"], limit=1, progress=False)
    with pytest.raises(ValueError, match="recompute ratio"):
        run_eval("musique", model, tokenizer, ["blend@lots"], limit=1, progress=False)


def test_cli_eval_writes_the_reports(tmp_path, capsys):
    assert cli_main(["eval", "musique", "--model", "stories260k", "--limit", "1", "--out", str(tmp_path),
                     "--max-new-tokens", "4", "--chunk-size", "64"]) == 0
    assert "| reuse |" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quality_vs_ttft.png", "samples.jsonl", "summary.csv",
                                                          "summary.json", "summary.md"]
    run = json.loads((tmp_path / "summary.json").read_text())["run"]  # the record names what made it
    assert "eval musique --model stories260k --limit 1" in run["command"]
    assert run["git_sha"] != "" and run["cpus"] >= 1 and run["versions"]["torch"] != "not installed"
    assert len(run["load_average"]) == 3 and len(run["load_average_written"]) == 3 and run["resumed"] == 0


def test_a_stopped_run_resumes_where_it_stopped(stories, tmp_path):
    model, tokenizer = stories
    methods = ["full", "reuse", "naive"]
    kwargs = dict(max_new_tokens=4, chunk_size=64, progress=False, out_dir=tmp_path, model_name="stories260k")
    whole = run_eval("musique", model, tokenizer, methods, limit=3, **kwargs)["samples"]
    # stopped during the second sample: its first method answered, the rest not
    kept = [dict(r, kept=True) for r in whole[:3]]  # marked: a resumed run must keep them, not redo them
    save_jsonl(kept + whole[3:4], tmp_path / "samples.jsonl")
    resumed = run_eval("musique", model, tokenizer, methods, limit=3, resume=True, **kwargs)["samples"]
    assert [(r["sample"], r["method"]) for r in resumed] == [(r["sample"], r["method"]) for r in whole]
    assert [r.get("kept") for r in resumed] == [True] * 3 + [None] * 6
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in whole]
    assert load_jsonl(tmp_path / "samples.jsonl") == resumed
    # the kept samples' provenance stays: the first run's entry, then the resume's own
    first = json.loads((tmp_path / "summary.json").read_text())["run"]
    assert first["resumed"] == 1 and [r["resumed"] for r in first["earlier_runs"]] == [0]
    run_eval("musique", model, tokenizer, methods, limit=3, resume=True, **kwargs)
    again = json.loads((tmp_path / "summary.json").read_text())["run"]
    assert again["resumed"] == 3 and [r["resumed"] for r in again["earlier_runs"]] == [0, 1]
    assert "earlier_runs" not in again["earlier_runs"][1]
    with pytest.raises(ValueError, match="cannot resume"):
        run_eval("musique", model, tokenizer, ["full", "reuse"], limit=3, resume=True, **kwargs)


def test_cli_eval_resumes_a_longer_run(tmp_path):
    args = ["eval", "musique", "--model", "stories260k", "--out", str(tmp_path), "--max-new-tokens", "4",
            "--chunk-size", "64"]
    assert cli_main(args + ["--limit", "1"]) == 0
    first = [dict(r, kept=True) for r in load_jsonl(tmp_path / "samples.jsonl")]
    save_jsonl(first, tmp_path / "samples.jsonl")
    assert cli_main(args + ["--limit", "2", "--resume"]) == 0
    records = load_jsonl(tmp_path / "samples.jsonl")
    assert records[:2] == first and [r["sample"] for r in records[2:]] == ["musique_s-1"] * 2
    assert cli_main(args + ["--limit", "2", "--resume", "--methods", "full"]) == 2  # another method list


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["longchat-topics-5", "longchat-lines-200", "musique"])
def test_reuse_answers_exactly_like_full_on_smollm2(smollm2, dataset):
    model, tokenizer = smollm2
    result = run_eval(dataset, model, tokenizer, ["full", "reuse"], limit=1, max_new_tokens=16,
                      model_name="smollm2-135m", progress=False)
    s = result["summary"]
    assert s["reuse"]["identical_to_full"] == 1.0 and s["reuse"]["n"] == 1
    assert s["reuse"]["ttft_mean_s"] < s["full"]["ttft_mean_s"]
    assert all(r["ttft_s"] > 0 and "score" in r for r in result["samples"])


def test_reuse_stores_the_context_rows_of_fulls_prefill_exactly(stories, tmp_path):
    """`full` hands its cache, cut to the context, to the reuse methods (the miss they would store):
    what they store reads back, through an exact reader of the folder, as a context-only prefill."""
    from kdn import KDN, KDNConfig
    from kdn.eval.methods import Full, Reuse

    model, tokenizer = stories
    sample = load_dataset("longchat-topics-5", limit=1)[0]
    enc = encode(tokenizer, sample, 512, 8)
    config = KDNConfig(chunk_size=64, disk_dir=str(tmp_path))
    full = Full().answer(model, enc, 8)
    reuse = Reuse(config).answer(model, enc, 8)
    assert reuse.tokens == full.tokens and reuse.hit_tokens >= enc.context_tokens - 64
    context = enc.ids[:, : enc.context_tokens]
    reader = KDN(KDNConfig(chunk_size=64, disk_dir=str(tmp_path)))
    cache, hit = reader.retrieve(model, context)  # all but the last token, which it prefills
    assert hit == enc.context_tokens - 1
    with torch.inference_mode():
        served = model(context[:, hit:], past_key_values=cache).logits[0, -1]
        truth = model(context).logits[0, -1]
    assert torch.allclose(served, truth, atol=1e-4)


def test_kvtc_is_calibrated_on_samples_it_is_not_judged_on(stories):
    model, tokenizer = stories
    methods = ["full", "reuse", "reuse+kvtc:ratio=8", "reuse+kvtc:ratio=32"]  # 32: beyond kvtc.RATIOS
    result = run_eval("musique", model, tokenizer, methods, limit=1,
                      max_new_tokens=4, chunk_size=64, progress=False, calibration_samples=2)
    evaluated = {r["sample"] for r in result["samples"]}
    assert result["calibration"]["samples"] == ["musique_s-1", "musique_s-2"]
    assert not evaluated & set(result["calibration"]["samples"]) and result["calibration"]["tokens"] > 500
    assert result["calibration"]["disjoint_in_content"] and len(result["calibration"]["content"]) == 64
    s = result["summary"]
    assert 0 < s["reuse+kvtc:ratio=8"]["stored_bytes_mean"] < s["reuse"]["stored_bytes_mean"] / 6
    # a ratio the calibration would not offer by default is fitted for the run that names it
    assert 0 < s["reuse+kvtc:ratio=32"]["stored_bytes_mean"] < s["reuse+kvtc:ratio=8"]["stored_bytes_mean"] / 2
    from kdn.eval.runner import calibrate_kvtc

    with pytest.raises(ValueError, match="lower --limit"):  # no text left that the evaluated samples do not hold
        calibrate_kvtc(model, tokenizer, [], load_dataset("musique"), 512, 4, progress=False)


@pytest.mark.parametrize("dataset", ["longchat-topics-5", "musique"])
def test_the_kvtc_calibration_shares_no_conversation_or_passage_with_the_evaluated_samples(dataset):
    """LongChat's records share conversations, MuSiQue's questions passages: the samples after the
    evaluated ones, taken whole, would calibrate on text the codec is then judged on. kdn's contexts
    keep only conversations / passages no evaluated sample holds (by content), drawing on another
    dataset when the dataset's own run out (LongChat's 50 records are built from 30 conversations),
    and the fit is refused for a context that shares any."""
    from kdn.eval.runner import _held, _runs_of, calibrate_kvtc, calibration_contexts, fallback_samples, formulas

    everything = load_dataset(dataset)  # the tests' slice (3 samples), or the full set under $KDN_SHARED
    for evaluated in (everything[:2], everything[:30]):
        contexts = calibration_contexts(everything, evaluated, 2, lambda: fallback_samples(dataset))
        assert len(contexts) == 2 and not _held(evaluated) & _held(contexts)
        common = formulas(everything)  # LongChat's stock replies
        assert not _runs_of(evaluated, common) & _runs_of(contexts, common)  # no run of 8 words of content either
        assert all(c.query == "" and c.segments for c in contexts)
    if dataset.startswith("longchat") and len(everything) > 30:  # the full set: records share conversations
        assert _held(everything[:30]) & _held(everything[30:32])
        assert not _held(everything) - _held(everything[:30])  # 30 records hold every conversation
    with pytest.raises(ValueError, match="shares"):
        calibrate_kvtc(None, None, everything[:1], everything[:3], 512, 8, progress=False)


def test_a_passage_overlapping_an_evaluated_one_is_not_calibration_text():
    """MuSiQue's passages are overlapping windows of the same articles: a later question's passage
    that hashes unlike every evaluated one but repeats 8 words of one is left out (the prompt's fixed
    wording, in every sample, does not count), and the fit is refused for a context holding it."""
    from kdn.eval.datasets import Sample
    from kdn.eval.runner import QA_INSTRUCTION, calibrate_kvtc, calibration_contexts

    article = " ".join(f"w{i}" for i in range(60))
    shifted = " ".join(f"w{i}" for i in range(40, 90))  # 20 words in common with the article
    other = " ".join(f"v{i}" for i in range(60))
    evaluated = [Sample("q0", (QA_INSTRUCTION + f"Title: A\n{article}\n\n",), "q", ("a",), "qa_f1")]
    later = [Sample("q1", (QA_INSTRUCTION + f"Title: B\n{shifted}\n\n",), "q", ("a",), "qa_f1"),
             Sample("q2", (QA_INSTRUCTION + f"Title: C\n{other}\n\n",), "q", ("a",), "qa_f1")]
    contexts = calibration_contexts(evaluated + later, evaluated, 2)
    assert [c.id for c in contexts] == ["q2"]
    with pytest.raises(ValueError, match="runs of 8 words"):
        calibrate_kvtc(None, None, later[:1], evaluated, 512, 8, progress=False)


def test_a_kvtc_run_resumes_only_with_the_same_calibration(stories, tmp_path):
    model, tokenizer = stories
    kwargs = dict(max_new_tokens=4, chunk_size=64, progress=False, out_dir=tmp_path, model_name="stories260k")
    methods = ["full", "reuse+kvtc:ratio=8"]
    run_eval("musique", model, tokenizer, methods, limit=1, **kwargs)
    assert run_eval("musique", model, tokenizer, methods, limit=1, resume=True, **kwargs)["samples"]
    with pytest.raises(ValueError, match="differs in calibration"):
        run_eval("musique", model, tokenizer, methods, limit=1, resume=True, calibration_samples=3, **kwargs)
    with pytest.raises(ValueError, match="differs in calibration"):  # a longer kvtc run calibrates on other text
        run_eval("musique", model, tokenizer, methods, limit=2, resume=True, **kwargs)
