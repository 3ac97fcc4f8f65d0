"""The "what it costs" table of docs/install.md (the README's two lines), made from what
`.ci/newcomer` (and `.ci/run`) recorded in
``benchmarks/results/newcomer/costs.jsonl``: every step's seconds with the machine's load average
before and after. The table sits between ``<!-- costs:begin -->`` and ``<!-- costs:end -->``.
Every CI run writes its own rows (each step, the test line and the whole run, with the CPU and the
commit) to ``/tmp/kdn-newcomer-costs.jsonl`` and prints the totals; to refresh the table, copy that
file here (or run ``KDN_COSTS=$PWD/benchmarks/results/newcomer/costs.jsonl .ci/newcomer``), then
this script.

    python benchmarks/readme_costs.py           # rewrite docs/install.md's table from the record
    python benchmarks/readme_costs.py --check   # exit 1 if its table is not the record's
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from readme_figures import splice

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "newcomer" / "costs.jsonl"
BEGIN, END = "<!-- costs:begin -->", "<!-- costs:end -->"


def table(record: Path = RECORD) -> str:
    """The Markdown table of the recorded steps."""
    rows = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{record} holds no steps; run .ci/newcomer first")
    dates = sorted({r["date"] for r in rows})
    where = sorted({f"{r['cpu']}, commit {r['commit']}" for r in rows if r.get("cpu")})
    lines = [f"Measured by CI (`.ci/run`, its `.ci/newcomer` in a fresh clone and venv) on a {rows[0]['cpus']}-core "
             f"machine ({', '.join(dates + where)}; `benchmarks/readme_costs.py` writes this table from "
             "`benchmarks/results/newcomer/costs.jsonl`, the file CI wrote):", "",
             "| step | time | load average (1 min) before / after |", "|---|---:|---:|"]
    for r in rows:
        minutes, seconds = divmod(int(r["seconds"]), 60)
        took = f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"
        step = f"{r['step']} ({r['date']})" if len(dates) > 1 else r["step"]
        lines.append(f"| {step} | {took} | {r['load_before']:.2f} / {r['load_after']:.2f} |")
    return "\n".join(lines) + "\n"


def render(readme: str, record: Path = RECORD) -> str:
    """``readme`` with the text between the markers replaced by :func:`table`."""
    return splice(readme, BEGIN, END, table(record))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    path = ROOT / "docs" / "install.md"
    readme = path.read_text(encoding="utf-8")
    updated = render(readme)
    if args.check:
        if updated != readme:
            print("docs/install.md's cost table differs from the record: run python benchmarks/readme_costs.py")
            return 1
        return 0
    path.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
