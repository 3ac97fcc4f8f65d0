"""`vllm serve` with the connector, as a deployment runs it (the engine in its own process), seen from
outside: answers through the OpenAI API, kdn's counters and latency histograms on vLLM's Prometheus
/metrics (every metric the repository's Grafana dashboard queries among them), and the worker's
admin endpoint acting on the running engine's store."""

from __future__ import annotations

from pathlib import Path

import pytest

import kdn
import test_vllm
from kdn.admin import ask
from test_vllm import run

pytestmark = pytest.mark.slow
setup = test_vllm.setup  # the fixture: (vLLM venv's python, SmolLM2's folder, prompts), for this module too


def test_vllm_serve_answers_through_openai_with_kdn_counters_on_metrics(setup, tmp_path):
    """`vllm serve` with the connector (the engine in its own process): a prompt over the engine's
    length is refused and a client that leaves mid-stream costs nothing (the engine keeps serving);
    the second question about the same document comes back sooner, and kdn's counters (per tier
    too, and the scheduler process' own: two questions of a new document at once, one waits) are
    on vLLM's Prometheus /metrics, with the latency histograms the repository's dashboard reads; the
    worker's admin endpoint sees the document the engine stored and evicts it from the running engine."""
    from transformers import AutoTokenizer

    import dashboards
    from redis_servers import free_port
    from vllm_servers import VLLMServer

    python, folder, _ = setup
    document = tmp_path / "document.txt"
    document.write_text((Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()[:6000])
    # kdn in memory only: vLLM serves from two processes (scheduler, worker), and the memory tier is
    # the worker's; the scheduler's lookups must reach it
    admin = f"http://127.0.0.1:{free_port()}"  # kdn's admin endpoint in the worker's process (kdn.admin)
    with VLLMServer(python, folder, tmp_path / "serve.log", kdn={"admin": admin[len("http://"):]}) as server:
        out = run(python, "vllm_client.py", "--url", server.url, "--model", folder, "--document", str(document))
        tokens = AutoTokenizer.from_pretrained(folder)(document.read_text())["input_ids"]
        held = ask(admin, "/v1/lookup", {"tokens": tokens})["tokens"]
        assert held >= 1024 and ask(admin, "/v1/stats")["memory"]["entries"] >= held // 256
        assert ask(admin, "/v1/evict", {"tokens": tokens})["evicted_chunks"] >= held // 256
        assert ask(admin, "/v1/lookup", {"tokens": tokens}) == {"tokens": 0}  # gone from the running engine
    first, second = out["answers"]
    assert second["ttft"] < first["ttft"] and first["text"] and second["text"]
    assert out["metrics"].get("vllm:kdn_loaded_tokens_total", 0) > 1000
    assert out["metrics"].get("vllm:kdn_stores_total", 0) >= 1
    assert out["too_long"] == "BadRequestError"
    assert out["metrics"].get("vllm:kdn_memory_chunks_total", 0) >= 1  # the second question's hit, by tier
    assert "vllm:kdn_layer_wait_seconds_total" in out["metrics"]  # what the forward waited for its layers
    # two questions of a new document at once: one waited for the other's prefill, a count that
    # lives in the scheduler's process and reaches /metrics too
    assert all(out["together"]) and out["metrics"].get("vllm:kdn_in_flight_waits_total", 0) >= 1
    # the latency histograms: one observation per lookup, load and store, their sums the counters'
    # seconds; the tiers' reads observed; every metric the repository's Grafana dashboard queries is here
    metrics = out["metrics"]
    for name in ("lookup", "load", "store"):
        assert metrics.get(f"vllm:kdn_{name}_duration_seconds_count", 0) >= 1, name
        assert metrics[f"vllm:kdn_{name}_duration_seconds_sum"] == pytest.approx(
            metrics[f"vllm:kdn_{name}_seconds_total"], rel=1e-6, abs=1e-9), name
    assert metrics["vllm:kdn_load_duration_seconds_count"] == metrics["vllm:kdn_loads_total"]
    assert metrics.get("vllm:kdn_tier_read_duration_seconds_count", 0) >= 1
    assert dashboards.named(dashboards.load()) - set(out["names"]) == set()
