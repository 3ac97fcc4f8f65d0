"""Rules the package's source keeps, checked by reading it: every forward call to a model names the
logits it needs (``logits_to_keep``), since a call without it computes a vocabulary-wide row for every
position (Qwen2.5: 151,936 floats per token, 1.2 GB for a 2K-token prefill) that KV-only paths throw away."""

from __future__ import annotations

import ast
from pathlib import Path

import kdn

PACKAGE = Path(kdn.__file__).parent


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
