"""A hybrid model in the HF face (mamba or linear-attention layers beside attention: Granite-4-H,
Qwen3-Next; :data:`kdn.layout.RESUMING_HYBRIDS`): the attention layers' KV is stored in chunks as any
model's, and each recurrent layer's state at the last chunk boundary of each prompt as one sealed
sidecar beside the chunk that ends there (as vLLM's align mode keeps one checkpoint per prompt: a
state is as large as many chunks), so a later prompt that shares that prefix resumes from it
(docs/models.md)."""

from __future__ import annotations

import logging
import struct
import time
import weakref

import torch
from transformers import DynamicCache

from kdn import _core
from kdn._core import InvalidInputError
from kdn.engine import Engine, HFTarget
from kdn.engine.layout import ModelLayout
from kdn.layout import cache_arg, cache_to_kv_list, check_length, output_cache

log = logging.getLogger("kdn")

_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_TENSOR = struct.Struct("<BB")  # dtype index, dimensions; then each dimension as <I


def refuse(layout: ModelLayout, what: str) -> None:
    """Raise InvalidInputError when ``layout`` is a hybrid model's: ``what`` (a face's call) is
    served for attention-only models; a hybrid's is served by ``generate``."""
    if layout.recurrent:
        raise InvalidInputError(f"{what} is not supported for a hybrid model (recurrent layers "
                                f"{list(layout.recurrent)}): kdn serves one through KDN.generate, which keeps the "
                                "state at a prompt's last chunk boundary")


def state_address(chunk_key: bytes) -> bytes:
    """Where the recurrent state at the end of the chunk filed under ``chunk_key`` is filed."""
    return _core.blake3(b"kdn/recurrent-state\0" + chunk_key, 16)


def pack_state(cache, layout: ModelLayout) -> bytes:
    """The recurrent layers' state in ``cache`` (batch 1): each layer's convolution window (its last
    ``kernel - 1`` inputs: all a continuation reads, as vLLM keeps it) and its recurrent state,
    each tensor as its dtype, shape and bytes."""
    parts = []
    for t in _state_tensors(cache, layout):
        t = t.detach().contiguous().cpu()
        parts += [_TENSOR.pack(_DTYPES.index(t.dtype), t.dim()), struct.pack(f"<{t.dim()}I", *t.shape),
                  t.view(torch.uint8).numpy().tobytes()]
    return b"".join(parts)


def _state_tensors(cache, layout: ModelLayout) -> list[torch.Tensor]:
    return [t for i in layout.recurrent
            for t in (cache.layers[i].conv_states[0][..., 1:], cache.layers[i].recurrent_states[0])]


_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its state's (dtype, shape)s


def state_shapes(model, layout: ModelLayout) -> list[tuple]:
    """``(dtype, shape)`` of each tensor :func:`pack_state` packs for ``model``, from a one-token
    forward (once per model object): what a stored state must hold to be read."""
    if model not in _SHAPES:
        cache = DynamicCache(config=model.config)
        device = next(model.parameters()).device
        with torch.no_grad():
            model(torch.ones(1, 1, dtype=torch.long, device=device), **cache_arg(cache), use_cache=True,
                  logits_to_keep=1)
        _SHAPES[model] = [(t.dtype, tuple(t.shape)) for t in _state_tensors(cache, layout)]
    return _SHAPES[model]


def unpack_state(payload: bytes, shapes: list[tuple], device) -> list[torch.Tensor]:
    """The tensors of :func:`pack_state` (conv, state per recurrent layer) on ``device``;
    InvalidInputError unless the payload holds exactly tensors of ``shapes`` (:func:`state_shapes`)."""
    out, at = [], 0
    while at < len(payload) and len(out) < len(shapes):
        code, dims = _TENSOR.unpack_from(payload, at)
        shape = struct.unpack_from(f"<{dims}I", payload, at + _TENSOR.size)
        at += _TENSOR.size + 4 * dims
        if code >= len(_DTYPES) or (_DTYPES[code], shape) != shapes[len(out)]:
            raise InvalidInputError(f"a stored recurrent state's tensor {len(out)} is {shape}, not {shapes[len(out)]}")
        dtype = _DTYPES[code]
        size = dtype.itemsize * int(torch.Size(shape).numel())
        raw = torch.frombuffer(bytearray(payload[at:at + size]), dtype=torch.uint8)
        out.append(raw.view(dtype).view(shape).to(device))
        at += size
    if at != len(payload) or len(out) != len(shapes):
        raise InvalidInputError(f"a stored recurrent state of {len(out)} tensors, {at} of {len(payload)} bytes read: "
                                f"expected {len(shapes)} tensors")
    return out


def hybrid_cache(model, layout: ModelLayout, kv: list[torch.Tensor] | None, state: list[torch.Tensor] | None):
    """An HF cache for ``model`` holding ``kv`` (the attention layers' K and V, kdn's order) and
    ``state`` (:func:`unpack_state`): where a prefill left off at a chunk boundary. Both None: empty."""
    cache = DynamicCache(config=model.config)
    length = 0 if kv is None else int(kv[0].shape[-2])
    attention = [i for i in range(len(cache.layers)) if i not in layout.recurrent]
    for n, i in enumerate(attention if kv is not None else ()):
        layer, k, v = cache.layers[i], kv[2 * n], kv[2 * n + 1]
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    for n, i in enumerate(layout.recurrent if state is not None else ()):
        layer, conv, recurrent = cache.layers[i], state[2 * n], state[2 * n + 1]
        window = torch.nn.functional.pad(conv, (1, 0))  # HF keeps `kernel` inputs; the oldest is never read
        layer.lazy_initialization(conv_states=window, recurrent_states=recurrent)
        layer.conv_states[0].copy_(window)
        layer.recurrent_states[0].copy_(recurrent)
        layer.has_previous_state[0] = True
        if hasattr(layer, "cumulative_length_linear"):  # transformers >= 5.25 counts a state layer's tokens
            layer.cumulative_length_linear.fill_(length)
    check_length(cache, length, "a hybrid cache rebuilt from a stored state")
    return cache


def attention_kv(cache, end: int) -> list[torch.Tensor]:
    """The first ``end`` positions of the attention layers' K and V in ``cache``, in kdn's order, on the CPU."""
    return [t[:1, :, :end].cpu() for t in cache_to_kv_list(cache)]


def held(engine: Engine, session, model, tokens, limit: int) -> tuple[int, list | None]:
    """``(tokens, state)``: the longest stored prefix of ``tokens`` (at most ``limit``) that ends at a
    chunk boundary whose recurrent state is stored and usable, and that state (:func:`unpack_state`,
    on the CPU); ``(0, None)`` if none. A state that fails its checksum or does not parse is dropped."""
    chunk = session.chunk_size
    found = engine.find(session, tokens, limit)
    addresses = [state_address(key) for key in found.keys[:found.tokens // chunk]]
    present = engine.sidecars.held(addresses)  # one check, not a read per boundary (most hold no state)
    for full in range(len(addresses), 0, -1):
        address = addresses[full - 1]
        payload = engine.sidecars.read(session, address) if present[full - 1] else None  # failing its checksum: None
        if payload is None:
            continue
        try:
            return full * chunk, unpack_state(payload, state_shapes(model, session.layout), "cpu")
        except (InvalidInputError, IndexError, ValueError, RuntimeError, struct.error) as e:
            log.warning("kdn: dropping an unusable stored recurrent state (treated as a miss): %s", e)
            engine.sidecars.drop(address)
    return 0, None


def load(engine: Engine, session, model, tokens, limit: int, started: float | None = None):
    """``(cache, load)``: the prefix :func:`held` names as an HF cache (None and a miss when there is
    none, or when its chunks cannot all be read: recomputed, never a state beside other KV)."""
    from kdn.engine.core import Load

    boundary, state = held(engine, session, model, tokens, limit)
    if not boundary:
        return None, Load()
    device = next(model.parameters()).device
    got = engine.load(session, tokens, boundary, HFTarget(device), None, started)
    if got.hit != boundary:  # a chunk went missing or failed its check after the lookup
        log.warning("kdn: a hybrid hit's chunks were not all read (%d of %d tokens); recomputed", got.hit, boundary)
        return None, Load()
    return hybrid_cache(model, session.layout, got.result, [t.to(device) for t in state]), got


def generate(engine: Engine, session, model, ids: torch.Tensor, keep: bool, started: float, **generate_kwargs):
    """:func:`kdn.integrations.hf.generate.generate` for a hybrid model (``session.layout.recurrent``):
    the stored prefix up to its last stored state, the prompt prefilled from there to its last chunk
    boundary (the state there kept), ``model.generate`` for the rest; then the new chunks and that
    state stored (not when the hit was lossy: KV computed over it is not exact). ``(generate's dict
    output, stats)``."""
    layout, chunk, n = session.layout, session.chunk_size, int(ids.shape[1])
    tokens = session.tokens(ids[0])
    cache, got = load(engine, session, model, tokens, n - 1, started)
    hit = got.hit
    cache = cache if cache is not None else hybrid_cache(model, layout, None, None)
    end = (n - 1) // chunk * chunk  # the last boundary before the prompt's last token
    forwards: list = []
    hook = model.register_forward_hook(lambda *_: forwards.append(time.perf_counter()))
    try:
        state = None
        if end > hit:  # up to the boundary, where the state is kept
            with torch.no_grad():  # not inference mode: generate updates these tensors in place
                model(ids[:, hit:end], **cache_arg(cache), use_cache=True, logits_to_keep=1)
            state = pack_state(cache, layout)
        out = model.generate(ids, return_dict_in_generate=True, use_cache=True, **cache_arg(cache), **generate_kwargs)
    finally:
        hook.remove()
    stats = {"hit_tokens": hit, "prompt_tokens": n}
    prompt_forward = int(state is not None)  # after the forward to the boundary, generate's first
    if len(forwards) > prompt_forward:
        stats["ttft_seconds"] = forwards[prompt_forward] - started
    record = got.finish()
    try:
        if keep and state is not None:
            saved = engine.save(session, tokens[:end], attention_kv(output_cache(out), end), record)
            if saved >= end:  # a state only beside chunks stored as exact
                engine.sidecars.write(session, state_address(session.prefix_keys(tokens[:end])[-1]), state)
    except Exception as exc:  # storing is best effort; the answer is already computed
        log.warning("kdn: storing the generated KV failed (%s); the result is returned unchanged", exc)
    return out, stats
