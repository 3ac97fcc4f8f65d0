"""The docstrings' examples are tests: every ``>>>`` example in python/kdn runs as written (doctest,
ELLIPSIS), each docstring top to bottom in a fresh folder, and its printed results must match.

Each docstring's example may use these names without defining them (everything else it defines):
``torch``, ``kdn`` (the package), ``model`` and ``tokenizer`` (stories260K), ``document`` and
``question`` (text), ``ids`` (``document`` tokenized, a [1, n] tensor) and the names of the module
it is written in. Redis examples name ``redis://127.0.0.1:6379/0``; they run against a loopback
server started here (the URL replaced).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import kdn
from redis_servers import RedisServer, require_redis

PACKAGE = Path(kdn.__file__).parent
DOCUMENT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
            "with her dog, Max. One day, Lily found a big red ball under a tree. ")
QUESTION = "What did Lily find?"
REDIS_URL = "redis://127.0.0.1:6379/0"
OPTIONAL = {"vllm"}  # modules whose docstrings can only be collected where these import


def _modules():
    yield "kdn", kdn
    for info in pkgutil.walk_packages(kdn.__path__, "kdn."):
        try:
            yield info.name, importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if e.name not in OPTIONAL:
                raise
            yield info.name, None


def _collect():
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests, unimportable = {}, []
    for name, module in _modules():
        if module is None:
            unimportable.append(name)
            continue
        for test in finder.find(module, name):
            if test.examples and test.filename and Path(test.filename).resolve().is_relative_to(PACKAGE):
                tests[test.name] = test
    return tests, unimportable


DOCTESTS, UNIMPORTABLE = _collect()


def test_every_example_is_collected():
    """Every ``>>>`` line of the package's sources belongs to a collected docstring (none hides in a
    module that does not import here, or in a string doctest does not search)."""
    written = {}
    for path in PACKAGE.rglob("*.py"):
        count = sum(1 for line in path.read_text().splitlines() if line.lstrip().startswith(">>>"))
        if count:
            written[path.resolve()] = count
    collected = {}
    for test in DOCTESTS.values():
        path = Path(test.filename).resolve()
        collected[path] = collected.get(path, 0) + sum(ex.source.count("\n") for ex in test.examples)
    hidden = {str(p): n for p, n in written.items() if collected.get(p, 0) < n}
    assert not hidden, f"examples not collected (lines written vs collected): {hidden}; unimportable: {UNIMPORTABLE}"
    assert len(DOCTESTS) >= 20


@pytest.fixture
def namespace():
    model, tokenizer = kdn.models.load("stories260k")  # a fresh one: an example may change its model
    return {"torch": torch, "kdn": kdn, "model": model, "tokenizer": tokenizer, "document": DOCUMENT,
            "question": QUESTION, "ids": tokenizer(DOCUMENT, return_tensors="pt").input_ids}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.mark.parametrize("name", sorted(DOCTESTS))
def test_docstring_example(name, namespace, tmp_path, monkeypatch, request):
    test = DOCTESTS[name]
    if any(REDIS_URL in ex.source for ex in test.examples):
        url = request.getfixturevalue("redis_url")
        test.examples = [doctest.Example(ex.source.replace(REDIS_URL, url), ex.want, ex.exc_msg, ex.lineno,
                                         ex.indent, ex.options) for ex in test.examples]
    monkeypatch.chdir(tmp_path)
    test.globs = {**test.globs, **namespace}
    out = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    result = runner.run(test, out=out.append, clear_globs=False)
    assert result.failed == 0, "".join(out)
    assert not any(doctest.SKIP in ex.options for ex in test.examples), "an example is skipped: run it here"
