"""The README and the docs site are a test: every Python, shell and YAML block runs as written, top
to bottom, the README then the pages in mkdocs.yml's order (tests/readme_blocks.py), in a folder where
only a bare clone's files are found; the site builds with ``mkdocs build --strict``; the README stays
a front page (at most 250 lines)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kdn.models.gguf import cache_root
from redis_servers import RedisServer, require_redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from readme_blocks import PAGE_DONE, blocks, pages  # noqa: E402

PAGES = pages(ROOT)


def test_every_block_is_run_or_says_where_it_is():
    found = [(page, b) for page in PAGES for b in blocks(page.read_text()) if b.lang in ("python", "bash", "yaml")]
    assert len(found) >= 12 and len(PAGES) >= 10
    for page, block in found:
        assert block.needs != "skip" or block.why, f"{page.name}:{block.line}: a skipped block says why"


def test_the_readme_is_a_front_page_and_the_site_builds_strict(tmp_path):
    """The README: the two commands, what kdn does, the map of the docs (issue 65: at most 250 lines);
    the docs site builds with every page in its nav and no broken link (mkdocs' strict mode)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250 and "# the demo" in readme.splitlines()[4]
    for page in PAGES[2:]:  # after the README and the site's home page; the lab notes through their index
        name = page.relative_to(ROOT).as_posix()
        assert f"({name})" in readme or page.parent.name == "results" and "(docs/results/index.md)" in readme, name
    pytest.importorskip("mkdocs")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "vllm" / "index.html").is_file()


def smollm2_checkpoint() -> Path:
    from kdn.models import smollm2

    return smollm2.converted_dir(smollm2.gguf_path())


class Reader:
    """``tests/readme_blocks.py --serve`` in a folder laid out like a bare clone (README.md, tests/data)
    with an empty cache folder that only sees the installed models, Redis blocks against a loopback
    server: it runs the pages it is sent one after the other in one namespace, as a reader reads them."""

    def __init__(self, tmp_path: Path):
        require_redis()
        try:
            from test_vllm import vllm_python

            self.vllm = ["--vllm-python", vllm_python(), "--checkpoint", str(smollm2_checkpoint())]
        except pytest.skip.Exception:  # no vLLM venv here: its block is skipped (CI requires it)
            self.vllm = []
        self.server = RedisServer(tmp_path / "redis")
        self.work = tmp_path / "clone"
        self.work.mkdir()
        (self.work / "tests").symlink_to(ROOT / "tests")
        xdg = tmp_path / "xdg"
        (xdg / "kdn").mkdir(parents=True)
        (xdg / "kdn" / "models").symlink_to(cache_root())
        env = {k: v for k, v in os.environ.items() if k not in ("KDN_DATA", "KDN_SHARED", "KDN_CONFIG")}
        env.update(XDG_CACHE_HOME=str(xdg), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "readme_blocks.py"), "--serve",
             "--redis", f"redis://127.0.0.1:{self.server.port}", *self.vllm],
            cwd=self.work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        with self.proc.stdout:  # closed here, at its end
            for line in self.proc.stdout:
                self.lines.put(line)
        self.lines.put(None)

    def run(self, page: Path, timeout: float = 1200) -> tuple[str, str]:
        """Run ``page``'s blocks: ``(verdict, output)``, the verdict "ok RAN SKIPPED" or "failed"."""
        self.proc.stdin.write(f"{page}\n")
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(1.0, deadline - time.monotonic()))
            if line is None:
                return "exited", "".join(out)
            if line.startswith(PAGE_DONE):
                return line[len(PAGE_DONE):].strip(), "".join(out)
            out.append(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
            self.proc.wait()
            self.pump.join(timeout=30)
            self.server.stop()


@pytest.fixture(scope="module")
def reader(smollm2, tmp_path_factory):
    reader = Reader(tmp_path_factory.mktemp("readme"))
    yield reader
    reader.close()


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_the_readme_and_the_docs_run_as_written(reader, page):
    """Each page's blocks, in mkdocs.yml's order after the README (one test each: pytest shows each
    page's progress and time), in one namespace: a page sees the names the pages before it defined,
    as a reader who runs the manual top to bottom (a page run alone, ``-k``, may miss them)."""
    verdict, output = reader.run(page)
    expected = [b for b in blocks(page.read_text()) if b.lang in ("python", "bash", "yaml") and b.needs != "skip"
                and (reader.vllm or b.needs != "vllm")]
    assert verdict.split()[:2] == ["ok", str(len(expected))], output[-6000:]
    if page.name == "evaluation.md":
        assert (reader.work / "eval_out" / "summary.md").is_file(), "the evaluation page's kdn eval wrote no report"


def test_the_cost_table_is_the_recorded_one():
    """The install page's cost table is written by benchmarks/readme_costs.py from .ci/newcomer's record."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_costs.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_headline_tables_are_written_from_their_records():
    """The docs' headline tables (vLLM hits, serving beside LMCache) are what
    ``benchmarks/readme_figures.py`` renders from the records they name, provenance included."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_figures.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sum(page.read_text().count("<!-- figures:") for page in PAGES) >= 6, "the docs lost their generated tables"


def _tables_without_a_record(text: str) -> list[str]:
    """First rows of the Markdown tables in ``text`` that are neither written by readme_figures.py nor
    preceded (since the previous table or heading) by prose naming a ``benchmarks/results/...`` record."""
    import re

    missing, prose, generated, in_table = [], "", False, False
    for line in text.splitlines():
        if line.startswith("<!-- figures:"):
            generated = line.endswith(":begin -->")
        if line.startswith("|"):
            if not in_table and not generated and not re.search(r"benchmarks/results/\S+", prose):
                missing.append(line)
            in_table, prose = True, ""
            continue
        in_table = False
        prose = "" if line.startswith("#") else prose + " " + line
    return missing


def test_every_measured_table_names_its_record():
    """A figure without a record is a guess: every table of the measured pages is generated from its
    record or names the results file or folder behind it (which the test above finds)."""
    sections = [s for page in ("measured.md", "vllm.md", "models.md") for s in
                (ROOT / "docs" / page).read_text().split("\n## ")]
    missing = [row for section in sections for row in _tables_without_a_record(section)]
    assert not missing, f"tables with no record named before them: {missing}"


_FIGURE = r"\b\d[\d,.]*\s?(?:ms|s|x|req/s|GB/s|MB/s|%|MiB|GiB)\b"  # a measured figure: a number and a unit


def _prose_without_a_record(text: str) -> list[str]:
    """Paragraphs of ``text`` quoting a measured figure with no ``benchmarks/results/...`` record named
    in them or in the paragraph (or generated table, whose provenance names one) before them under
    the same heading."""
    import re

    missing, named = [], False
    for para in re.split(r"\n\s*\n", text):
        if para.lstrip().startswith("#"):
            named = False
        if re.search(r"benchmarks/results/\S+", para):
            named = True
        elif not para.lstrip().startswith(("|", "```", "<!--")) and re.search(_FIGURE, para) and not named:
            missing.append(para.strip()[:120])
    return missing


def test_every_measured_figure_in_prose_names_its_record():
    """Figures quoted in the measured sections' prose name the record they come from (or follow, under
    the same heading, a paragraph or generated table that does)."""
    sections = [s for page in ("measured.md", "vllm.md", "models.md") for s in
                (ROOT / "docs" / page).read_text().split("\n## ")]
    missing = [para for section in sections for para in _prose_without_a_record(section)]
    assert not missing, f"figures with no record named: {missing}"


def test_the_prose_rule_catches_a_figure_without_a_record():
    text = "# a\nkdn: 12 ms (`benchmarks/results/x/`)\n\nthen 3x faster\n\n# b\nabout 40 ms\n\nno figure here\n"
    assert _prose_without_a_record(text) == ["# b\nabout 40 ms"]


def test_the_record_rule_catches_a_table_without_one():
    text = "# t\nfigures from memory\n\n| a | b |\n|---|---|\n\nfrom `benchmarks/results/x/`\n\n| c |\n"
    assert _tables_without_a_record(text) == ["| a | b |"]


def test_every_results_folder_the_readme_quotes_holds_records():
    """A figure the README quotes names the records behind it (``benchmarks/results/...``): each such
    path exists in the repository and holds a record (JSON, JSONL, a log, a table or a plot)."""
    import re

    text = "".join(page.read_text() for page in PAGES)
    quoted = set(re.findall(r"`(benchmarks/results/[^` ]+)`", text))
    assert len(quoted) >= 10, "the pattern no longer finds the docs' record paths"
    kinds = {".json", ".jsonl", ".log", ".md", ".csv", ".png"}
    empty = []
    for path in sorted(quoted):
        target = ROOT / path
        records = [p for p in (target.rglob("*") if target.is_dir() else [target]) if p.suffix in kinds and p.exists()]
        if not records:
            empty.append(path)
    assert not empty, f"the README quotes records that are not there: {empty}"


def test_every_headline_command_names_a_benchmark_and_options_it_takes():
    """``benchmarks/headline.py``'s comparisons (the commands the README quotes) run scripts that exist,
    with options their parsers accept (each script's ``--help`` lists them), into ``results/``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from headline import COMPARISONS

    assert {"vllm", "serving-32", "ttft"} <= set(COMPARISONS)
    helps: dict[str, str] = {}
    for name, (_, argv) in COMPARISONS.items():
        script = ROOT / "benchmarks" / argv[0]
        assert script.exists(), f"{name}: no {script}"
        if argv[0] not in helps:
            helps[argv[0]] = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                                            timeout=120, cwd=script.parent, check=True).stdout
        options = [a for a in argv[1:] if a.startswith("--")]
        assert all(o in helps[argv[0]] for o in options), f"{name}: {options} not all in {argv[0]} --help"
        assert argv[argv.index("--out") + 1].startswith("results/"), f"{name} writes outside benchmarks/results"
