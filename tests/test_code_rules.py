"""Rules the package's source keeps, checked by reading it: every forward call to a model names the
logits it needs (``logits_to_keep``), since a call without it computes a vocabulary-wide row for every
position (Qwen2.5: 151,936 floats per token, 1.2 GB for a 2K-token prefill) that KV-only paths throw away."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from kdn.config import KDNConfig
from kdn.config_sources import OTHER_ENV

# the checkout's source, not the installed package: CI installs kdn into site-packages, where neither
# tests/, benchmarks/ nor .ci/ sit beside it
ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "kdn"
assert (PACKAGE / "__init__.py").is_file(), f"the rules read the checkout's source; {PACKAGE} is not there"


def _forward_calls(tree: ast.AST):
    """Calls of a name ``model`` or an attribute ``.model`` (``model.generate(...)`` is not one: it
    keeps only the last position's logits itself)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id == "model") or (
                    isinstance(func, ast.Attribute) and func.attr == "model"):
                yield node


def test_every_forward_names_the_logits_it_keeps():
    calls, missing = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in _forward_calls(ast.parse(path.read_text(), str(path))):
            calls += 1
            if not any(k.arg == "logits_to_keep" for k in call.keywords):
                missing.append(f"{path.relative_to(PACKAGE)}:{call.lineno}")
    assert calls >= 5, "the rule found no forward calls: its pattern no longer matches the package"
    assert not missing, f"forward calls without logits_to_keep: {missing}"


def test_the_rule_catches_a_forward_without_it():
    tree = ast.parse("out = model(ids, use_cache=True)\nok = model(ids, logits_to_keep=1)\n")
    calls = list(_forward_calls(tree))
    assert [any(k.arg == "logits_to_keep" for k in c.keywords) for c in calls] == [False, True]


# -- the engine is closed: faces, tests and benchmarks drive kdn through kdn.engine.Engine ----------
ENGINE_PARTS = ("chunks",)  # an Engine's chunk reader/writer: engine/ only
DOOR = ROOT / "tests" / "forge.py"  # the named helper tests that forge stored blobs go through


def _an_engine(node: ast.AST) -> bool:
    """Whether an expression names an engine: ``engine`` or ``x.engine``."""
    return (isinstance(node, ast.Name) and node.id == "engine"
            or isinstance(node, ast.Attribute) and node.attr == "engine")


def _reads_of_parts(tree: ast.AST) -> list[int]:
    """Lines that read an engine's parts: ``x.chunks``, an engine's ``tiers`` (``engine.tiers``,
    ``kdn.engine.tiers``), or import :class:`ChunkIO`."""
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and (n.attr in ENGINE_PARTS or n.attr == "tiers" and _an_engine(n.value))]
    lines += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              and any(a.name == "ChunkIO" for a in n.names)]
    return lines


def _outside_the_engine():
    yield from (p for p in PACKAGE.rglob("*.py") if "engine" not in p.relative_to(PACKAGE).parts)
    yield from (p for p in (ROOT / "tests").glob("*.py") if p != DOOR)
    yield from (ROOT / "benchmarks").rglob("*.py")


def test_no_module_outside_the_engine_reads_its_parts():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(_outside_the_engine())
             for line in _reads_of_parts(ast.parse(path.read_text(), str(path)))]
    assert not found, f"engine parts read outside kdn/engine (use the Engine's API, or tests/forge.py): {found}"


def test_the_engine_rule_catches_a_side_door():
    tree = ast.parse("kv = cache.engine.chunks.read(s, t, 4)\n"
                     "from kdn.engine.chunks import ChunkIO\nok = engine.load(s)\nkdn.engine.tiers.put(k, b)\n"
                     "manager.tiers[0]\n")
    assert sorted(_reads_of_parts(tree)) == [1, 2, 4]


def _unit(module: str) -> str:
    """The layer a module belongs to: kdn's top-level module or subpackage (``kdn`` for the package's face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kdn"


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Which of kdn's top-level units each unit imports (lazy imports in functions included)."""
    units = {_unit(m) for m in sources} | {"_core"}
    edges: dict[str, set[str]] = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kdn":
                named = [a.name for a in node.names] if node.module == "kdn" else [_unit(node.module)]
                edges.setdefault(_unit(module), set()).update(n if n in units else "kdn" for n in named)
    for unit, targets in edges.items():
        targets.discard(unit)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets if a in reach(b)})


def _package_sources() -> dict[str, str]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def test_no_import_runs_back_up_a_layer():
    assert cycles(import_graph(_package_sources())) == []


def test_the_layer_rule_catches_a_cycle():
    sources = {"kdn.engine.core": "from kdn.delivery import stream", "kdn.delivery.stream": "from kdn.engine import x",
               "kdn.storage": "from kdn import _core"}
    assert cycles(import_graph(sources)) == [("delivery", "engine")]


MODEL_LIBRARIES = ("transformers", "peft", "vllm", "sglang")  # read by their adapters and faces alone
FACES = ("kdn.layout", "kdn.integrations", "kdn.models", "kdn.edits", "kdn.blend")


def model_library_imports(sources: dict[str, str], under: tuple = ("kdn.engine", "kdn.storage")) -> list[str]:
    """``module: imported`` for every import (lazy ones in functions included) of a model library or a
    face by a module ``under`` the engine or the storage: they read models only through what a face hands them."""
    found = []
    for module, text in sources.items():
        if not module.startswith(under):
            continue
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{module}: {n}" for n in names
                      if n.split(".")[0] in MODEL_LIBRARIES or n.startswith(FACES)]
    return sorted(found)


def test_the_engine_and_the_storage_read_no_model_library():
    assert model_library_imports(_package_sources()) == []


def test_the_model_library_rule_catches_a_lazy_import():
    sources = {"kdn.engine.core": "def f():\n    from transformers import AutoConfig\n    import kdn.layout\n",
               "kdn.storage.disk": "import numpy", "kdn.integrations.hf.facade": "import transformers"}
    assert model_library_imports(sources) == ["kdn.engine.core: kdn.layout", "kdn.engine.core: transformers"]


def test_no_file_in_the_package_is_over_400_lines():
    lines = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > 400}
    assert not long, f"split these (a file has one job): {long}"


def test_no_cpp_cuda_or_test_file_is_over_600_lines():
    """The size rule for the C++ and CUDA core and for the tests: a file over 600 lines holds more
    than one responsibility (the package's Python files have 400)."""
    files = [*(ROOT / "csrc").rglob("*.cpp"), *(ROOT / "csrc").rglob("*.h"), *(ROOT / "kernels").rglob("*.cu"),
             *(ROOT / "kernels").rglob("*.cuh"), *(ROOT / "tests").glob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 600}
    assert files and not long, f"split these (a file has one job): {long}"


_ENV_READ = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(?\[?\s*|getenv\(\s*)["'](KDN_[A-Z0-9_]+)["']"""
                       r"""|\$\{?(KDN_[A-Z0-9_]+)|(?:^|\s|export\s)(KDN_[A-Z0-9_]+)=""", re.M)


def _env_reads(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in _ENV_READ.finditer(text)}


def test_every_kdn_variable_the_project_reads_is_known_to_the_config():
    """A KDN_ variable that the config does not know is warned about as a typo (with warnings as errors
    in the tests, a failure): every one that the package, tests, benchmarks or CI scripts read or set
    is either a setting or listed in ``config_sources.OTHER_ENV``."""
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
             *(p for p in (ROOT / ".ci").iterdir() if p.is_file())]
    settings = {f"KDN_{f.name.upper()}" for f in dataclasses.fields(KDNConfig)}
    read = {var: path.relative_to(ROOT) for path in files if path != Path(__file__)
            for var in _env_reads(path.read_text(errors="replace"))}
    assert "KDN_SHARED" in read and "KDN_VLLM_PYTHON" in read, "the rule's pattern no longer finds the reads"
    unknown = {var: str(path) for var, path in read.items() if var not in settings | OTHER_ENV}
    assert not unknown, f"KDN_ variables read but unknown to kdn's config (add them to OTHER_ENV): {unknown}"


def test_the_rule_finds_reads_in_python_and_shell():
    text = 'os.environ.get("KDN_A")\nos.environ["KDN_B"]\necho ${KDN_C:-x} $KDN_D\nKDN_E=1 pytest\n' \
           'export KDN_F=2\n-DKDN_BUILD_TESTS=ON\n'
    assert _env_reads(text) == {"KDN_A", "KDN_B", "KDN_C", "KDN_D", "KDN_E", "KDN_F"}
