"""SGLang HiCache's storage tier over kdn (kdn.integrations.sglang): pages one process stores another
reads exactly; a page of another shard, tenant or size is a miss; the class keeps SGLang's interface,
read from the source of SGLang's wheel (KDN_SGLANG_WHEEL: .ci/run downloads it), and, where SGLang
imports (KDN_SGLANG_PATH: a folder holding it and what its hicache_storage module imports), is built
by SGLang's own backend factory."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import types
import zipfile

import pytest
import torch

from disk_helpers import python_process
from kdn import InvalidInputError
from kdn.integrations.sglang import KDNHiCacheStorage


def storage_config(disk_dir, tp_rank: int = 0, tp_size: int = 2, mla: bool = False, **kdn_settings):
    """The fields of SGLang's HiCacheStorageConfig kdn reads, as SGLang fills them."""
    return types.SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                 attn_cp_size=1, is_mla_model=mla, model_name="Qwen/Qwen2.5-0.5B",
                                 is_storage_writer=not mla or tp_rank == 0,
                                 extra_config={"backend_name": "kdn", "kdn": {"disk_dir": str(disk_dir),
                                                                             **kdn_settings}})


def pages(n: int, seed: int) -> list[torch.Tensor]:
    """n host-pool pages (2 x 4 layers x 64 tokens x 128 bf16 each)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 64, 128, generator=g).to(torch.bfloat16) for _ in range(n)]


WRITER = """
import sys, torch
from test_sglang import pages, storage_config
from kdn.integrations.sglang import KDNHiCacheStorage
store = KDNHiCacheStorage(storage_config(sys.argv[1]), None)
print(store.batch_set([f"hash-{i}" for i in range(6)], pages(6, seed=1)))
store.engine.flush()
"""


def test_pages_one_process_stores_another_reads_exactly(tmp_path):
    proc = python_process(WRITER, str(tmp_path), stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=120)[0].strip() == "True" and proc.returncode == 0
    store = KDNHiCacheStorage(storage_config(tmp_path), None)
    keys = [f"hash-{i}" for i in range(8)]
    assert store.batch_exists(keys) == 6 and store.exists("hash-5") and not store.exists("hash-6")
    into = [torch.empty(2, 4, 64, 128, dtype=torch.bfloat16) for _ in range(8)]
    got = store.batch_get(keys, into)
    assert [g is not None for g in got] == [True] * 6 + [False] * 2
    assert all(torch.equal(a, b) for a, b in zip(got[:6], pages(6, seed=1)))  # bit-exact
    assert store.get("hash-0", torch.empty(2, 4, 64, 127, dtype=torch.bfloat16)) is None  # a wrong size: a miss
    with pytest.raises(ValueError, match="target_locations"):
        store.batch_get(keys[:1])


def test_another_shard_or_tenant_never_reads_the_pages_and_mla_ranks_share(tmp_path):
    writer = KDNHiCacheStorage(storage_config(tmp_path), None)
    assert writer.batch_set(["h0", "h1"], pages(2, seed=2))
    writer.engine.flush()
    assert KDNHiCacheStorage(storage_config(tmp_path, tp_rank=1), None).batch_exists(["h0", "h1"]) == 0
    assert KDNHiCacheStorage(storage_config(tmp_path, namespace="acme"), None).batch_exists(["h0", "h1"]) == 0
    mla = [KDNHiCacheStorage(storage_config(tmp_path, tp_rank=r, mla=True), None) for r in (0, 1)]
    assert mla[1].batch_set(["m0"], pages(1, seed=3)) and not mla[0].exists("m0")  # rank 1 of MLA does not write
    assert mla[0].batch_set(["m0"], pages(1, seed=3)) and mla[0].exists("m0")
    mla[0].engine.flush()
    into = [torch.empty(2, 4, 64, 128, dtype=torch.bfloat16)]
    assert torch.equal(mla[1].batch_get(["m0"], into)[0], pages(1, seed=3)[0])  # every MLA rank reads it


def test_a_damaged_page_is_a_miss_and_bad_settings_are_typed_errors(tmp_path):
    store = KDNHiCacheStorage(storage_config(tmp_path, memory_bytes="1MiB"), None)
    assert store.batch_set(["d0", "d1"], pages(2, seed=4))
    store.engine.flush()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 60000)
    assert len(files) == 2
    for f in files:  # flip a byte in the middle of each page file
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    reader = KDNHiCacheStorage(storage_config(tmp_path), None)
    into = [torch.empty(2, 4, 64, 128, dtype=torch.bfloat16) for _ in range(2)]
    assert reader.batch_get(["d0", "d1"], into) == [None, None]
    with pytest.raises(InvalidInputError, match="did you mean"):
        KDNHiCacheStorage(storage_config(tmp_path, disk_bytez="1GiB"), None)


def _wheel_source(path: str) -> str:
    wheel = os.environ.get("KDN_SGLANG_WHEEL")
    if not wheel:
        if os.environ.get("KDN_REQUIRE_SERVERS") == "1":
            pytest.fail("KDN_SGLANG_WHEEL is not set (.ci/run downloads SGLang's wheel)")
        pytest.skip("KDN_SGLANG_WHEEL is not set: pip download --no-deps sglang, and point it at the wheel")
    with zipfile.ZipFile(wheel) as z:
        return z.read(path).decode()


def test_the_face_keeps_sglangs_interface_read_from_its_source():
    tree = ast.parse(_wheel_source("sglang/srt/mem_cache/hicache_storage.py"))
    base = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HiCacheStorage")
    abstract = {f.name: [a.arg for a in f.args.args] for f in base.body if isinstance(f, ast.FunctionDef)
                and any(getattr(d, "id", None) == "abstractmethod" for d in f.decorator_list)}
    assert {"get", "batch_get", "set", "batch_set", "exists"} <= set(abstract)
    for name, params in abstract.items():  # same parameters, in order
        assert list(inspect.signature(getattr(KDNHiCacheStorage, name)).parameters) == params, name
    exists = next(f for f in base.body if isinstance(f, ast.FunctionDef) and f.name == "batch_exists")
    assert list(inspect.signature(KDNHiCacheStorage.batch_exists).parameters) == [a.arg for a in exists.args.args]
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HiCacheStorageConfig")
    fields = {s.target.id for s in config.body if isinstance(s, ast.AnnAssign)}
    read = set(vars(storage_config("/tmp"))) - {"is_storage_writer"}  # a property of SGLang's config
    assert read <= fields, read - fields
    factory = _wheel_source("sglang/srt/mem_cache/storage/backend_factory.py")
    assert "backend_class(storage_config, kwargs)" in factory  # how SGLang builds a dynamic backend


FACTORY = """
import json, sys, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                              is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                              model_name="m", extra_config=json.loads(sys.argv[1]))
store = StorageBackendFactory.create_backend("dynamic", config, None)
page = torch.arange(4096, dtype=torch.float32)
stored = store.batch_set(["p0"], [page])
into = torch.empty(4096)
print(json.dumps({"subclass": isinstance(store, HiCacheStorage), "stored": stored,
                  "exists": store.batch_exists(["p0", "p1"]), "exact": torch.equal(store.get("p0", into), page)}))
"""


def test_sglangs_backend_factory_builds_it(tmp_path):
    path = os.environ.get("KDN_SGLANG_PATH")
    if not path:
        if os.environ.get("KDN_REQUIRE_SERVERS") == "1":
            pytest.fail("KDN_SGLANG_PATH is not set (.ci/run makes it with .ci/sglang-path)")
        pytest.skip("KDN_SGLANG_PATH is not set: .ci/sglang-path SGLANG_WHEEL makes the folder (triton, ...)")
    extra = {"backend_name": "kdn", "module_path": "kdn.integrations.sglang", "class_name": "KDNHiCacheStorage",
             "kdn": {"disk_dir": str(tmp_path)}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", FACTORY, json.dumps(extra)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"subclass": True, "stored": True, "exists": 1,
                                                                "exact": True}
