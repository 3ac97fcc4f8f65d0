"""What the HF face reads of transformers' caches and PEFT's adapters, checked once per model and
process before kdn serves it: kdn's own path (a prefill, its KV read into kdn's layout and laid back
into a new HF cache — with a hybrid's recurrent state packed and unpacked — then the rest of a short
prompt) against the model's own one-shot forward, and PEFT's adapter switches against what kdn keys.
A model kdn cannot vouch for is refused by name (:class:`kdn.compat.UnvouchedError`): generate,
lookup, store and retrieve serve it nothing (a full prefill, one warning); the other calls raise.

Example:
    >>> from kdn.integrations.hf import vouch
    >>> vouch.reason(model, kdn.KDN().session(model).layout) is None   # kdn's reading is the model's
    True
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch
import transformers
from transformers import DynamicCache

from kdn.compat import UnvouchedError, refused
from kdn.engine.layout import ModelLayout
from kdn.layout import cache_arg, cache_to_kv_list, check_length, full_cache, kv_list_to_cache

PROMPT, PREFIX = 16, 9  # the canary: a 16-token prompt resumed after 9 tokens
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # max |logit difference| / max |logit|; 16-bit: 3e-2

_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> None (vouched) or the reason
_lock = threading.Lock()


def reason(model, layout: ModelLayout) -> str | None:
    """None when kdn's reading of ``model``'s caches (and adapters) gives the model's own logits,
    else why not; computed once per model object (a few forwards of 16 tokens)."""
    with _lock:
        if model in _verdicts:
            return _verdicts[model]
    training = getattr(model, "training", False)
    try:
        model.eval()  # a model being trained runs dropout: the canary compares the computation, not its noise
        _check_adapters(model)
        _check_resume(model, layout)
        verdict = None
    except UnvouchedError as e:
        verdict = str(e)
    except Exception as e:  # noqa: BLE001 - any failure of kdn's path on this release is a refusal, not a crash
        verdict = f"kdn's cache path failed on transformers {transformers.__version__}: {type(e).__name__}: {e}"
    finally:
        model.train(training)
    with _lock:
        _verdicts[model] = verdict
    return verdict


def served(model, layout: ModelLayout, what: str) -> bool:
    """Whether ``what`` (a face's call) may serve ``model``; False after one warning naming why."""
    why = reason(model, layout)
    if why is not None:
        refused(f"{what} for {type(model).__name__}", why)
    return why is None


def check(model, layout: ModelLayout, what: str) -> None:
    """Raise :class:`kdn.compat.UnvouchedError` naming ``what`` unless kdn can vouch for ``model``."""
    why = reason(model, layout)
    if why is not None:
        raise UnvouchedError(f"{what} refuses {type(model).__name__}: {why}")


@torch.no_grad()
def _check_resume(model, layout: ModelLayout) -> None:
    """kdn's hit path on a 16-token prompt (9 served, 7 computed) against one forward over it."""
    config = model.config.get_text_config()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(int(config.vocab_size), 1000), (1, PROMPT), generator=generator).to(device)
    whole = model(ids, **cache_arg(DynamicCache(config=model.config)), use_cache=True, logits_to_keep=1).logits[0, -1]
    whole = whole.float()
    first = None if layout.recurrent else full_cache(model)  # a windowed model's: every position kept
    first = DynamicCache(config=model.config) if first is None else first
    model(ids[:, :PREFIX], **cache_arg(first), use_cache=True, logits_to_keep=1)
    if layout.recurrent:
        from kdn.integrations.hf import hybrid

        state = hybrid.unpack_state(hybrid.pack_state(first, layout), hybrid.state_shapes(model, layout), device)
        cache = hybrid.hybrid_cache(model, layout, hybrid.attention_kv(first, PREFIX), state)
    else:
        kv = [t[:1, :, :PREFIX] for t in cache_to_kv_list(first)]
        if len(kv) != 2 * layout.layers or any(t.shape[-2] != PREFIX for t in kv):
            raise UnvouchedError(f"kdn read {len(kv) // 2} layers of KV from transformers "
                                 f"{transformers.__version__}'s cache, not {layout.layers} of {PREFIX} tokens")
        cache = kv_list_to_cache(model, [t.clone() for t in kv])
        check_length(cache, PREFIX, "a cache laid from kdn's KV")
    resumed = model(ids[:, PREFIX:], **cache_arg(cache), use_cache=True, logits_to_keep=1).logits[0, -1].float()
    error = float((resumed - whole).abs().max() / whole.abs().max().clamp_min(1e-6))
    limit = TOLERANCE.get(next(model.parameters()).dtype, 3e-2)
    if not error <= limit:
        raise UnvouchedError(f"a prompt resumed from kdn's reading of transformers {transformers.__version__}'s "
                             f"cache gives logits {error:.2g} (relative) from the model's own forward "
                             f"(at most {limit:g})")


def _check_adapters(model) -> None:
    """A PEFT model's adapter layers as :func:`kdn.keys.adapter_state` reads them: the fields it keys
    exist with their meaning, and switching the adapters off changes what it reads."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    from kdn.keys import adapter_state

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        return
    for m in layers:
        active, disabled, merged = (getattr(m, name, None) for name in ("active_adapters", "disable_adapters",
                                                                         "merged_adapters"))
        if not isinstance(active, (list, str)) or not isinstance(disabled, bool) or not isinstance(merged, list):
            raise UnvouchedError(f"PEFT {installed_peft()}'s adapter layer {type(m).__name__} does not keep "
                                 "active_adapters / disable_adapters / merged_adapters as kdn reads them")
    state = adapter_state(model)
    if hasattr(model, "disable_adapter") and not any(m.disable_adapters for m in layers):
        with model.disable_adapter():
            off = adapter_state(model)
        if off == state:
            raise UnvouchedError(f"switching PEFT {installed_peft()}'s adapters off does not change what kdn "
                                 "reads of them: two adapter sets would share keys")


def installed_peft() -> str:
    return getattr(sys.modules.get("peft"), "__version__", "?")
