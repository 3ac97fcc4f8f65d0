"""The metrics a Grafana dashboard of the repository queries, and the ones kdn's vLLM connector exports
(read from its source, so that a test without vLLM can compare them)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kdn-vllm.json"
METRICS = ROOT / "python" / "kdn" / "integrations" / "vllm" / "metrics.py"
_NAME = re.compile(r"\bvllm:[A-Za-z0-9_:]+")


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables' queries."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def named(dashboard: dict) -> set[str]:
    """The metric names (``vllm:...``, as /metrics shows them) the dashboard's queries read."""
    return {name for expr in queries(dashboard) for name in _NAME.findall(expr)}


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def exported(source: str | None = None) -> set[str]:
    """The names kdn's connector puts on /metrics: ``vllm:kdn_<name>_total`` per counter of ``NAMES``,
    ``_bucket``/``_sum``/``_count`` per histogram of ``HISTOGRAMS`` and ``TIER_READS``."""
    values = {}
    for node in ast.parse(source if source is not None else METRICS.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    names = {f"vllm:kdn_{name}_total" for name in values["NAMES"]}
    for histogram in [*values["HISTOGRAMS"].values(), values["TIER_READS"]]:
        names |= {f"{histogram}_{part}" for part in ("bucket", "sum", "count")}
    return names
