"""The registered edits: ``kvzip`` (pruned chunks under the edit's addresses) and ``steer``
(sidecars beside the exact KV, served with an attention bias): what each computes at a deposit and
how a reader is served it (:class:`kdn.edits.EditKind`)."""

from __future__ import annotations

import time

from kdn._core import InvalidInputError
from kdn.edits import Edit, EditKind, autospans, kvzip, register, steer, stored
from kdn.engine import HFTarget, Load
from kdn.layout import kv_list_to_cache


@register
class KVzip(EditKind):
    """Query-agnostic pruning (:mod:`kdn.edits.kvzip`): each full chunk's kept rows, pooled (or in the
    masked layout under a ``kvtc`` tier), beside a bitmask of what was kept."""

    name, version = "kvzip", 2
    params = {"keep": (0.3, lambda v: 0 < v <= 1, "a share of tokens in (0, 1]"),
              "sink": (4, lambda v: v >= 0 and float(v).is_integer(), "a whole number of tokens >= 0")}

    def prepare(self, deposit) -> None:
        deposit.layout_masked = stored.masked_layout(deposit.kdn, deposit.session)

    def compute(self, deposit, edit: Edit) -> int:
        if deposit.scored is None and deposit.keys:  # one scoring pass serves every kvzip edit of a deposit
            tokenizer = deposit.tokenizer
            instruction = tokenizer(kvzip.INSTRUCTION, add_special_tokens=False)["input_ids"] if tokenizer else []
            deposit.scored = kvzip.scores(deposit.model, deposit.kv, deposit.ids, list(instruction))
        chunks, masks = stored.edited_chunks(deposit.kv, deposit.scored, deposit.keys, deposit.session.chunk_size,
                                             edit, stored.rope_of(deposit.model), deposit.layout_masked)
        deposit.planned += chunks
        deposit.sidecars += masks
        return sum(tokens * sum(t[0, :, 0].nbytes for t in rows) for _, rows, _, tokens in chunks) \
            + sum(len(p) for _, p in masks)

    def after(self, deposit, edit: Edit) -> None:
        if deposit.tail and deposit.keys:  # where its readers' exact KV ends
            deposit.sidecars.append(stored.tail_sidecar(edit, deposit.keys[-1], deposit.tail))

    def read(self, engine, model, tokens, limit: int, edit: Edit):
        cache, hit, spec, bias = stored.read(engine, model, tokens, limit, edit)
        return (cache, Load(hit, lossy=True, edit=spec, bias=bias)) if hit else None


@register
class Steer(EditKind):
    """Attention steering (:mod:`kdn.edits.steer`): the emphasized spans as sidecars beside the exact
    KV; a reader is served the exact KV and the bias that steers the model's best-profiled heads."""

    name, version, serves_exact = "steer", 1, True
    params = {"alpha": (0.01, lambda v: 0 < v <= 1, "a scale in (0, 1]"),
              "heads": (16, lambda v: v >= 1 and float(v).is_integer(), "a whole number of heads >= 1")}

    def prepare(self, deposit) -> None:
        steer.check_model(deposit.model)
        prompt, tokenizer = deposit.prompt, deposit.tokenizer
        deposit.offsets = tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"] \
            if isinstance(prompt, str) else None
        if deposit.auto and deposit.offsets is None:
            raise InvalidInputError("deposit: emphasize='auto' needs the prompt as text and its tokenizer")
        if not deposit.auto:
            deposit.emphasized = steer.token_mask(deposit.emphasize, len(deposit.ids), deposit.offsets)

    def compute(self, deposit, edit: Edit) -> int:
        if deposit.emphasized is None:  # "auto": the sentences the model itself names, found once
            t0 = time.perf_counter()
            spans, answer = autospans.find(deposit.model, deposit.tokenizer, deposit.prompt, deposit.kv)
            if not spans:
                raise InvalidInputError(f"deposit: emphasize='auto' found no sentence of the text in the model's "
                                        f"answer ({answer[:80]!r}); give the spans (emphasize=[(start, end), ...])")
            deposit.emphasized = steer.token_mask(spans, len(deposit.ids), deposit.offsets)
            deposit.found = {"spans": spans, "answer": answer, "seconds": time.perf_counter() - t0}
        if stored.head_profile(deposit.kdn, deposit.model, deposit.tokenizer) is None:
            raise InvalidInputError("deposit: steering profiles the model's heads once; pass tokenizer=...")
        chunk = deposit.session.chunk_size
        mine = [(edit.address(key), steer.pack_flags(deposit.emphasized[i * chunk:(i + 1) * chunk]))
                for i, key in enumerate(deposit.keys)]
        deposit.sidecars += mine
        return sum(len(p) for _, p in mine)

    def read(self, engine, model, tokens, limit: int, edit: Edit):
        found = stored.steering(engine, model, tokens, limit, edit)
        if not found:
            return None
        device = next(model.parameters()).device
        load = engine.load(engine.session(model), tokens, limit, HFTarget(device))  # the exact KV, read whole
        if not load.hit:
            return None
        return kv_list_to_cache(model, load.result), Load(load.hit, lossy=True, edit=edit.spec, bias=found[0])
