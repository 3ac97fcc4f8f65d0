"""Model fingerprints and chunk keys: same model + same tokens -> same key, in any process."""

from __future__ import annotations

import json
import weakref

import numpy as np
import torch

from kdn import _core
from kdn._core import InvalidInputError

FORMAT_VERSION = 1
_SAMPLES_PER_TENSOR = 4096
# Runtime switches and names that do not change what the model computes.
_CONFIG_IGNORED = {
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "transformers_version", "dtype", "torch_dtype", "quantization_config", "name_or_path",
}
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _config_json(config) -> str:
    items = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _CONFIG_IGNORED}
    return json.dumps(items, sort_keys=True, default=str)


def _weights_sample(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    if flat.numel() > _SAMPLES_PER_TENSOR:
        index = torch.arange(_SAMPLES_PER_TENSOR, device=flat.device) * (flat.numel() - 1) // (_SAMPLES_PER_TENSOR - 1)
        flat = flat[index]
    return flat.to(torch.float32).cpu().numpy().tobytes()


def model_fingerprint(model: torch.nn.Module, refresh: bool = False) -> bytes:
    """16-byte identity of a model: architecture config, dtype and weights.

    The weights part hashes every tensor's name, shape, dtype and 4096 evenly spaced values
    (all values of smaller tensors), so loading the same checkpoint anywhere gives the same
    fingerprint while a different checkpoint or a fine-tune does not. The result is cached per
    model object; pass ``refresh=True`` after changing weights in place.

    Example:
        >>> fp = model_fingerprint(model)   # b'\\x8f...' (16 bytes)
    """
    if not refresh and model in _fingerprints:
        return _fingerprints[model]
    parts = [b"kdn/model", str(FORMAT_VERSION).encode(), _config_json(model.config).encode()]
    for name, tensor in model.state_dict().items():
        parts += [name.encode(), str(tuple(tensor.shape)).encode(), str(tensor.dtype).encode()]
        parts.append(_weights_sample(tensor))
    digest = _core.blake3(b"\0".join(parts), 16)
    _fingerprints[model] = digest
    return digest


def token_array(token_ids, vocab_size: int) -> np.ndarray:
    """Validate token ids (list, numpy, torch; 1-D or batch-1 2-D) into a contiguous uint32 array."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    ids = np.asarray(token_ids)
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


def prefix_keys(fingerprint: bytes, tokens: np.ndarray, chunk_size: int) -> list[bytes]:
    """Chained 16-byte keys of the full chunks of ``tokens`` (see csrc/include/kdn/keys.h)."""
    return _core.prefix_chunk_keys(fingerprint, tokens, chunk_size)


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
