"""The Grafana dashboard in deploy/grafana: a well-formed dashboard whose every kdn query names a
metric the connector exports (a vLLM engine's /metrics is checked in tests/test_vllm_serve.py)."""

from __future__ import annotations

import dashboards

VLLM_OWN = {"vllm:prompt_tokens_total"}  # vLLM's own metrics the dashboard divides by


def test_the_dashboard_is_well_formed_and_every_panel_reads_the_chosen_prometheus():
    dashboard = dashboards.load()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 8 and dashboard["uid"] == "kdn-vllm"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert all(t["expr"].count("(") == t["expr"].count(")") for t in panel["targets"]), panel["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model_name"}


def test_every_metric_the_dashboard_queries_is_one_kdn_exports_or_vllms_own():
    named = dashboards.named(dashboards.load())
    assert named - dashboards.exported() - VLLM_OWN == set()
    # the latency histograms are on it, each tier's reads included
    assert {"vllm:kdn_load_duration_seconds_bucket", "vllm:kdn_tier_read_duration_seconds_bucket",
            "vllm:kdn_lookup_duration_seconds_bucket", "vllm:kdn_store_duration_seconds_bucket"} <= named


def test_the_rule_catches_a_metric_nobody_exports():
    source = 'NAMES = ("lookups",)\nHISTOGRAMS = {"load_seconds": "vllm:kdn_load_duration_seconds"}\n' \
             'TIER_READS = "vllm:kdn_tier_read_duration_seconds"\n'
    dashboard = {"panels": [{"targets": [{"expr": "rate(vllm:kdn_lookups_total[5m]) + vllm:kdn_lookup_total"}]}]}
    assert dashboards.named(dashboard) - dashboards.exported(source) == {"vllm:kdn_lookup_total"}
