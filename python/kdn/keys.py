"""Model fingerprints and chunk keys: same model + same tokens -> same key, in any process."""

from __future__ import annotations

import itertools
import json
import weakref

import numpy as np
import torch

from kdn import _core
from kdn._core import InvalidInputError

FORMAT_VERSION = 1
# Bumped when what the fingerprint covers changes (2: every weight byte instead of a sample; 3: the
# tensors a checkpoint holds, by sorted name, so a checkpoint's files give the same fingerprint;
# 4: ``architectures`` ignored, as save_pretrained fills it in, also in the saved model's own config).
FINGERPRINT_VERSION = 4
# Runtime switches and names that do not change what the model computes.
_CONFIG_IGNORED = {
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "transformers_version", "dtype", "torch_dtype", "quantization_config", "name_or_path",
    "architectures",  # the head class, set by save_pretrained: the KV is the base model's
}
# model -> (state signature, fingerprint)
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _config_json(config) -> str:
    items = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _CONFIG_IGNORED}
    return json.dumps(items, sort_keys=True, default=str)


def _state_signature(model: torch.nn.Module) -> tuple:
    """Cheap identity of the model's current tensors: where they live, their dtype and their
    in-place version counter. ``.to(dtype)``, ``load_state_dict`` and optimizer steps change it."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return tuple((t.data_ptr(), t.dtype, t.device, t._version) for t in tensors)


def _tensor_bytes(name: str, tensor: torch.Tensor) -> memoryview:
    if tensor.device.type == "meta":
        raise InvalidInputError(f"model tensor {name!r} is on the meta device (weights not loaded); "
                                "kdn needs the real weights to know which model it serves")
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def _checkpoint_names(model: torch.nn.Module) -> list[str]:
    """The names of the tensors a checkpoint of ``model`` holds, sorted: its state dict less the
    tied aliases that ``save_pretrained`` leaves out (an output embedding tied to the input one)."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    return sorted(name for name in model.state_dict() if name not in tied)


def _fingerprint(config, names: list[str], tensor_of) -> bytes:
    """BLAKE3 over the config and, for each name in order, its shape, dtype and bytes."""
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(b"kdn/model\0%d\0" % FINGERPRINT_VERSION)
    h.update(_config_json(config).encode())
    for name in names:
        tensor = tensor_of(name)
        h.update(b"\0%s\0%s\0%s\0" % (name.encode(), str(tuple(tensor.shape)).encode(), str(tensor.dtype).encode()))
        h.update(_tensor_bytes(name, tensor))
    return h.digest(16)


def model_fingerprint(model: torch.nn.Module, refresh: bool = False) -> bytes:
    """16-byte identity of a model: architecture config, dtype and every weight byte.

    BLAKE3 (multithreaded, the ``blake3`` package) over the config and, for every tensor a checkpoint
    of the model holds (its state dict less tied aliases), by sorted name: its name, shape, dtype and
    all its bytes. The same checkpoint in the same dtype gives the same fingerprint in any process,
    and :func:`checkpoint_fingerprint` gives it from the checkpoint's files without loading the
    model (what a serving engine's scheduler does); a fine-tune that changes one value, or a cast to
    another dtype, does not.
    Cost: one pass over the weights at memory bandwidth (SmolLM2-135M fp32, 538 MB: ~0.2 s here;
    a 7B model in fp16, 14 GB: a few seconds), once per model object. The result is cached per
    model object and recomputed when its tensors change (a new dtype or device, ``load_state_dict``,
    in-place updates that bump tensor versions); pass ``refresh=True`` after writing weights through
    ``.data``, which torch does not track.

    Example:
        >>> import copy
        >>> fp = model_fingerprint(model)
        >>> len(fp), fp == model_fingerprint(copy.deepcopy(model).to(torch.bfloat16))   # another dtype
        (16, False)
    """
    signature = _state_signature(model)
    cached = _fingerprints.get(model)
    if not refresh and cached is not None and cached[0] == signature:
        return cached[1]
    state = model.state_dict()
    digest = _fingerprint(model.config, _checkpoint_names(model), state.__getitem__)
    _fingerprints[model] = (signature, digest)
    return digest


def checkpoint_fingerprint(folder, dtype: torch.dtype | str) -> bytes:
    """:func:`model_fingerprint` of the HF checkpoint in ``folder`` (``config.json`` and
    ``*.safetensors``) loaded in ``dtype``, computed from the files: the model is built on the meta
    device (for its tensor names), and each tensor is read, cast to ``dtype`` and hashed.

    Example:
        >>> model.save_pretrained("checkpoint")          # config.json + model.safetensors
        >>> checkpoint_fingerprint("checkpoint", torch.float32) == model_fingerprint(model)
        True
    """
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidInputError(f"checkpoint_fingerprint: unknown dtype {dtype!r}")
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        raise InvalidInputError(f"{folder} is not an HF checkpoint folder (config.json and *.safetensors)")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    where = {}
    handles = [safe_open(str(f), framework="pt") for f in files]
    for handle in handles:
        for name in handle.keys():
            where[name] = handle
    names = _checkpoint_names(skeleton)
    missing = [n for n in names if n not in where]
    if missing:
        raise InvalidInputError(f"{folder}: the checkpoint lacks {len(missing)} tensors of the model, "
                                f"e.g. {missing[0]!r}")
    return _fingerprint(skeleton.config, names, lambda name: where[name].get_tensor(name).to(dtype))


def token_array(token_ids, vocab_size: int) -> np.ndarray:
    """Validate token ids (list, numpy, torch; 1-D or batch-1 2-D) into a contiguous uint32 array."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    try:
        ids = np.asarray(token_ids)
    except ValueError as e:  # ragged nested lists
        raise InvalidInputError(f"token_ids must be a flat list (or [1, n]) of integers: {e}") from None
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise InvalidInputError(f"token_ids must be 1-D (or [1, n]); got shape {tuple(ids.shape)}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise InvalidInputError(f"token_ids must be integers, got dtype {ids.dtype}")
    if ids.size:
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            raise InvalidInputError(
                f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the vocabulary [0, {vocab_size})"
            )
    return np.ascontiguousarray(ids, dtype=np.uint32)


def prefix_keys(fingerprint: bytes, tokens: np.ndarray, chunk_size: int, include_partial: bool = False) -> list[bytes]:
    """Chained 16-byte keys of the full chunks of ``tokens`` (and of a trailing partial chunk with
    ``include_partial``; see csrc/include/kdn/keys.h)."""
    return _core.prefix_chunk_keys(fingerprint, tokens, chunk_size, include_partial)


def tenant_fingerprint(fingerprint: bytes, namespace: str | None = None, key: bytes = b"") -> bytes:
    """The fingerprint a tenant's keys derive from: the model's ``fingerprint`` itself when there is
    no ``namespace`` and no ``key`` (one shared space), else
    ``BLAKE3[keyed by key]("kdn/tenant" | fingerprint | namespace)[:16]``. Every chunk key, probe key,
    segment key and blob header of the tenant follows from it, so tenants share nothing and, with
    a ``key`` (:meth:`kdn.KDNConfig.mac_key`), cannot even compute each other's names.

    Example:
        >>> fp = bytes(16)
        >>> tenant_fingerprint(fp) == fp, tenant_fingerprint(fp, "a") == tenant_fingerprint(fp, "b")
        (True, False)
    """
    if namespace is None and not key:
        return fingerprint
    body = b"kdn/tenant\0" + fingerprint + (b"\1" + namespace.encode() if namespace is not None else b"\0")
    return _core.blake3(body, 16, key=key) if key else _core.blake3(body, 16)


def shard_fingerprint(fingerprint: bytes, first: int, heads: int, total: int) -> bytes:
    """The fingerprint the chunks of a shard of a model's KV are keyed by: KV heads ``[first, first +
    heads)`` of its ``total`` (what one tensor-parallel rank holds), so a shard is never read as the
    whole model's KV nor as another shard's; the model's own ``fingerprint`` when the shard is every head.

    Example:
        >>> fp = bytes(16)
        >>> shard_fingerprint(fp, 0, 4, 4) == fp, shard_fingerprint(fp, 0, 2, 4) == shard_fingerprint(fp, 2, 2, 4)
        (True, False)
    """
    if not 0 <= first < first + heads <= total:
        raise InvalidInputError(f"KV heads [{first}, {first + heads}) are not a shard of {total} heads")
    if heads == total:
        return fingerprint
    return _core.blake3(b"kdn/heads\0" + fingerprint + np.array([first, heads, total], "<u4").tobytes(), 16)


def _field(data: bytes | None) -> bytes:
    """A length-prefixed field (u32 length, ``0xFFFFFFFF`` for none): fields never run into each other."""
    if data is None:
        return b"\xff\xff\xff\xff"
    return np.uint32(len(data)).tobytes() + data


def request_scope(tenant: str | None = None, adapter: bytes | None = None, inputs: bytes = b"") -> bytes | None:
    """16-byte id of what, beyond its tokens, a request's KV depends on: its ``tenant`` (vLLM's
    ``cache_salt``, the facade's per-call ``namespace=``: any string, surrogates included), its LoRA
    ``adapter`` (the fingerprint of its weights, :func:`adapter_fingerprint`) and its other
    ``inputs`` (multimodal hashes and positions, as bytes); None when there is none of them.
    :meth:`kdn.engine.ModelSession.within` derives a session's keys from it, so two requests share KV
    only when all three agree. The same tenant string is the same scope in every face.

    Example:
        >>> request_scope() is None, request_scope("acme") == request_scope("acme"), len(request_scope("acme"))
        (True, True, 16)
        >>> request_scope("acme") != request_scope("acme", adapter=bytes(16))
        True
    """
    if tenant is None and adapter is None and not inputs:
        return None
    name = None if tenant is None else tenant.encode("utf-8", "surrogatepass")
    return _core.blake3(b"kdn/scope\0" + _field(name) + _field(adapter) + _field(inputs), 16)


def scoped_fingerprint(fingerprint: bytes, scope: bytes) -> bytes:
    """The fingerprint a request ``scope``'s keys derive from (:func:`request_scope`), inside the
    root ``fingerprint`` (a model's, in a config's tenant): no config namespace shares it."""
    return _core.blake3(b"kdn/within\0" + fingerprint + scope, 16)


_ADAPTER_CONFIG_IGNORED = {"base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping"}


def adapter_fingerprint(folder) -> bytes:
    """16-byte identity of the PEFT / LoRA adapter saved in ``folder`` (what vLLM's ``LoRARequest``
    names by ``lora_path``): BLAKE3 over its ``adapter_config.json`` (parsed, less where it came
    from) and every other file's name and bytes, in name order. Its weights, not its name or id: two
    adapters with one name differ, one adapter under two names is the same. An InvalidInputError
    when the folder holds no adapter."""
    from pathlib import Path

    import blake3

    folder = Path(folder)
    config_path = folder / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != "adapter_config.json")
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"{folder} holds no readable adapter (adapter_config.json): {e}") from None
    if not isinstance(config, dict) or not files:
        raise InvalidInputError(f"{folder} holds no adapter weights beside adapter_config.json")
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(b"kdn/adapter\0")
    kept = {k: v for k, v in config.items() if k not in _ADAPTER_CONFIG_IGNORED}
    h.update(json.dumps(kept, sort_keys=True, default=str).encode())
    for path in files:
        if path.suffix.lower() in (".md", ".txt"):
            continue  # a model card
        h.update(b"\0" + path.name.encode("utf-8", "surrogatepass") + b"\0")
        try:
            h.update_mmap(str(path))
        except OSError as e:
            raise InvalidInputError(f"cannot read the adapter file {path}: {e}") from None
    return h.digest(16)


def adapter_state(model) -> bytes:
    """Which of an HF PEFT model's adapters compute (b"" for a model without adapter layers): every
    adapter layer's active adapters, whether adapters are disabled (``disable_adapter()``) and which
    are merged. :func:`model_fingerprint` covers every adapter's weights (they are in the state
    dict) but not which of them run; kdn's HF sessions fold this in, so a switch changes the keys."""
    import sys

    if "peft" not in sys.modules:  # a model with PEFT layers imported peft
        return b""
    from peft.tuners.tuners_utils import BaseTunerLayer

    parts = []
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            active = module.active_adapters
            parts.append(f"{name}|{sorted(active) if isinstance(active, list) else active}|"
                         f"{bool(module.disable_adapters)}|{sorted(module.merged_adapters)}")
    return "\n".join(parts).encode()


SEGMENT_KEY_VERSION = 1


def segment_key(fingerprint: bytes, prefix: np.ndarray, tokens: np.ndarray) -> bytes:
    """16-byte key of a segment's KV: depends only on the model, the tokens it was computed behind
    (``prefix``, e.g. BOS or a system prompt) and its own tokens, never on where it is used.

    ``BLAKE3("kdn/segment" | u32 version | fingerprint | u32 len(prefix) | prefix | tokens)[:16]``,
    tokens as little-endian u32.
    """
    header = b"kdn/segment" + np.uint32(SEGMENT_KEY_VERSION).tobytes() + fingerprint
    body = np.uint32(len(prefix)).tobytes() + prefix.astype("<u4").tobytes() + tokens.astype("<u4").tobytes()
    return _core.blake3(header + body, 16)
