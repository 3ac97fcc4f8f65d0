"""Shared fixtures: real models (stories260K, SmolLM2-135M) and tiny random Llama/Mistral/Qwen2 configs."""

from __future__ import annotations

import pytest
import torch

import kdn
from kdn.models.tiny import tiny_model


@pytest.fixture(scope="session")
def stories():
    """(model, tokenizer) of stories260K, fp32."""
    return kdn.models.load("stories260k")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct, fp32 (installed by `kdn install smollm2-135m`)."""
    return kdn.models.load("smollm2-135m")


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
