"""What the vLLM connector reads of vLLM's internals, in one table (:data:`READS`), so that a release
that renames or drops one is caught instead of read as its default: CI checks every field here (and
the connector's methods against ``KVConnectorBase_V1``'s) in the source of each vLLM it meets, the
newest release's wheel included (``tests/test_vllm_interface.py``); at run time a request object
that lacks a field kdn keys by is served nothing (:func:`missing_request_fields`).

Example:
    >>> from kdn.integrations.vllm.vouch import READS
    >>> "cache_salt" in READS[("vllm/v1/request.py", "Request")]
    True
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable

# (source file in the vllm package, class) -> the attributes kdn reads of its objects
READS = {
    ("vllm/v1/request.py", "Request"): ("request_id", "prompt_token_ids", "cache_salt", "lora_request",
                                        "mm_features", "prompt_embeds", "kv_transfer_params", "block_hashes"),
    ("vllm/v1/core/sched/output.py", "SchedulerOutput"): ("scheduled_new_reqs", "scheduled_cached_reqs",
                                                          "num_scheduled_tokens"),
    ("vllm/v1/core/sched/output.py", "NewRequestData"): ("req_id", "num_computed_tokens", "block_ids"),
    ("vllm/v1/core/sched/output.py", "CachedRequestData"): ("req_ids", "new_block_ids", "num_computed_tokens"),
    ("vllm/v1/kv_cache_interface.py", "KVCacheConfig"): ("kv_cache_groups",),
    ("vllm/v1/kv_cache_interface.py", "KVCacheGroupSpec"): ("kv_cache_spec", "layer_names"),
    ("vllm/v1/kv_cache_interface.py", "SlidingWindowSpec"): ("sliding_window", "block_size"),
    ("vllm/v1/kv_cache_interface.py", "FullAttentionSpec"): ("sliding_window", "block_size"),
    ("vllm/config/kv_transfer.py", "KVTransferConfig"): ("engine_id", "kv_connector_extra_config",
                                                         "kv_load_failure_policy"),
    ("vllm/config/vllm.py", "VllmConfig"): ("model_config", "cache_config", "parallel_config", "scheduler_config",
                                            "kv_transfer_config", "kv_events_config"),
    ("vllm/config/cache.py", "CacheConfig"): ("block_size", "cache_dtype"),
    ("vllm/config/model.py", "ModelConfig"): ("model", "dtype", "max_model_len", "use_mla"),
    ("vllm/config/parallel.py", "ParallelConfig"): ("tensor_parallel_size", "pipeline_parallel_size"),
    ("vllm/config/scheduler.py", "SchedulerConfig"): ("async_scheduling",),
}

# The connector's own methods (every other method it defines must be one of KVConnectorBase_V1's or
# SupportsHMA's, with the same parameters: a hook vLLM renamed would never be called)
OWN_METHODS = ("attention_kernel",)

KEYED_FIELDS = ("cache_salt", "lora_request", "mm_features", "prompt_embeds")  # what a request's keys hold

# Fields a newer vLLM dropped on purpose, each with the line of vLLM's source that says what replaced
# it (tests/test_vllm_interface.py checks that line where the field is gone)
DROPPED = {
    ("vllm/v1/core/sched/output.py", "CachedRequestData", "resumed_req_ids"):
        ("vllm/v1/core/sched/scheduler.py", "A resumed request is re-sent in full, like a new one"),
}


def resumed_req_ids(cached) -> set | list:
    """The requests of a step's ``CachedRequestData`` that were preempted and now start again: its
    ``resumed_req_ids`` where it has them; none from vLLM 0.34 on, which re-sends a resumed request
    among the step's new ones (:data:`DROPPED`)."""
    return cached.resumed_req_ids if hasattr(cached, "resumed_req_ids") else ()


def missing_request_fields(request) -> list[str]:
    """The fields of :data:`KEYED_FIELDS` a live request lacks: a request kdn cannot key exactly (a
    vLLM that moved ``cache_salt`` would otherwise share KV between tenants)."""
    return [name for name in KEYED_FIELDS if not hasattr(request, name)]


def runs_v2_model_runner(vllm_config) -> bool:
    """Whether vLLM runs its V2 model runner: its config's ``use_v2_model_runner`` where it has one;
    from vLLM 0.34 on, which removed the V1 runner (and the field), always."""
    if hasattr(vllm_config, "use_v2_model_runner"):
        return bool(vllm_config.use_v2_model_runner)
    import vllm

    from kdn.compat import version_tuple

    return version_tuple(getattr(vllm, "__version__", "0")) >= (0, 34, 0)


def class_attributes(classes: dict, name: str) -> set:
    """Every attribute the class ``name`` of ``classes`` (``{name: ast.ClassDef}`` of one source file)
    and its bases among them declare, assign to ``self`` or define."""
    found, c = set(), classes.get(name)
    if c is None:
        return found
    for node in c.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, ast.Assign):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
            for s in ast.walk(node):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
                found |= {t.attr for t in targets
                          if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self"}
    for base in c.bases:
        if isinstance(base, ast.Name):
            found |= class_attributes(classes, base.id)
    return found


def classes_of(text: str) -> dict:
    """``{name: ast.ClassDef}`` of the top-level classes in a source file's ``text``."""
    return {c.name: c for c in ast.parse(text).body if isinstance(c, ast.ClassDef)}


def unread_fields(read: Callable[[str], str]) -> dict:
    """``{"path:Class": [fields]}`` of :data:`READS` that the vLLM whose files ``read(path)`` returns
    lacks (a missing file or class: all its fields); empty when kdn can read all it reads."""
    missing = {}
    for (path, name), fields in READS.items():
        try:
            lacking = set(fields) - class_attributes(classes_of(read(path)), name)
        except (OSError, KeyError, SyntaxError):
            lacking = set(fields)
        if lacking:
            missing[f"{path}:{name}"] = sorted(lacking)
    return missing


@functools.lru_cache(maxsize=1)
def installed_vllm_lacks() -> str | None:
    """Why kdn cannot vouch for its reading of the installed vLLM (a field of :data:`READS` it lacks),
    or None: read once per process from the installed package's source."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "vLLM is not installed"
    root = Path(list(spec.submodule_search_locations)[0]).parent
    missing = unread_fields(lambda path: (root / path).read_text())
    if not missing:
        return None
    import vllm

    lacking = "; ".join(f"{where}: {', '.join(fields)}" for where, fields in missing.items())
    return (f"vLLM {getattr(vllm, '__version__', '?')} lacks fields kdn reads of it ({lacking}): kdn cannot "
            "vouch for this release")
