"""KV editing at deposit: named, versioned, parametrised transforms of a stored cache.

An edited cache is its own fidelity class, exactly as a lossy codec's chunks are: each edited chunk
is filed under an address derived from the exact chunk's key and the edit's canonical spec (name,
version, parameters), so an exact reader, or a reader of another edit, never meets it. Readers get
edited KV only by naming the edit (``KDN.generate(..., edits="kvzip:keep=0.3")``), and KV computed
over edited KV is never stored (the fidelity rule, :mod:`kdn.engine.served`).

Registered edits (``EDITS``):

- ``kvzip:keep=R`` (:mod:`kdn.edits.kvzip`): query-agnostic pruning (KVzip, arXiv 2505.23416). Every
  (layer, KV head, token) is scored by the largest attention it receives while the model
  reconstructs the context; the ``R`` share with the highest scores is kept, ranked together over
  layers, heads and tokens (a head that reads much keeps much), sinks always; positions are kept.
  Stored dense: each chunk's kept rows pooled per layer beside a bitmask of what was kept.
- ``steer:alpha=A,heads=H`` (:mod:`kdn.edits.steer`): attention steering (PASTA, arXiv 2311.02262).
  The spans emphasized at deposit (``emphasize=``) are kept in a sidecar beside the exact KV; a
  reader naming the edit runs the model's ``H`` best-profiled heads with attention to the other
  context tokens scaled by ``A``. The KV served is the exact KV.

Example:
    >>> cache = kdn.KDN(kdn.KDNConfig(chunk_size=16))
    >>> report = cache.deposit(model, ids, edits=["kvzip:keep=0.3"])     # token ids, or text with tokenizer=
    >>> prompt = tokenizer(document + question, return_tensors="pt").input_ids
    >>> out = cache.generate(model, prompt, edits="kvzip:keep=0.3", max_new_tokens=8)
    >>> cache.last_generate["edit"], cache.last_generate["hit_tokens"]
    ('kvzip:keep=0.3,sink=4', 48)
"""

from __future__ import annotations

import dataclasses

import blake3

from kdn._core import InvalidInputError


class EditKind:
    """One registered edit (:func:`register`): ``name``, ``version`` (bumped when its output changes),
    ``params`` (``{name: (default, check, what it must be)}``), and what it does at deposit and when
    read. ``serves_exact``: its readers are served the exact KV (so a deposit must keep it). The
    deposit (:func:`kdn.edits.stored.deposit`) calls :meth:`prepare` once per kind before its
    prefill, :meth:`compute` per edit after it, :meth:`after` once the exact KV is filed; a reader
    (:func:`kdn.integrations.hf.load_cache`) calls :meth:`read`."""

    name = ""
    version = 0
    params: dict = {}
    serves_exact = False

    def prepare(self, deposit) -> None:
        """Checks and inputs this edit needs before the deposit's prefill (InvalidInputError)."""

    def compute(self, deposit, edit: Edit) -> int:
        """Add ``edit``'s chunks and sidecars of the prefilled prompt to the deposit; their bytes."""
        raise NotImplementedError

    def after(self, deposit, edit: Edit) -> None:
        """More to file once the deposit's exact KV is stored (before the edit's own chunks)."""

    def read(self, engine, model, tokens, limit: int, edit: Edit):
        """``(cache, load)``: the prompt's leading chunks as stored by ``edit``, as an HF cache and a
        :class:`kdn.engine.Load`; None when none are."""
        raise NotImplementedError


EDITS: dict[str, EditKind] = {}


def register(kind: type[EditKind]) -> type[EditKind]:
    """Register an edit kind under its ``name`` (a class decorator)."""
    EDITS[kind.name] = kind()
    return kind


@dataclasses.dataclass(frozen=True)
class Edit:
    """One parsed edit: ``name``, ``version`` (bumped when its output changes) and ``params``."""

    name: str
    version: int
    params: tuple  # sorted (name, value) pairs

    @property
    def kind(self) -> EditKind:
        """What the edit does (its registered :class:`EditKind`)."""
        return EDITS[self.name]

    @property
    def spec(self) -> str:
        """Canonical text: ``name:k=v,...`` (what :func:`parse` reads, what the address hashes)."""
        return self.name + (":" + ",".join(f"{k}={v:g}" for k, v in self.params) if self.params else "")

    def param(self, name: str) -> float:
        return dict(self.params)[name]

    def address(self, key: bytes) -> bytes:
        """Where the edited form of the chunk ``key`` is filed: a hash of the key, the edit's spec and
        its version, as long as the key (never equal to an exact or a lossy-coded chunk's address)."""
        h = blake3.blake3(b"kdn/edit\0%d\0%s\0" % (self.version, self.spec.encode()))
        h.update(key)
        return h.digest(len(key))

    def __str__(self) -> str:
        return self.spec


def parse(spec) -> Edit:
    """An :class:`Edit` from ``"name:k=v,..."`` (or an Edit). An unknown name or parameter, or a
    value out of range, is an InvalidInputError that names it."""
    if isinstance(spec, Edit):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidInputError(f"an edit is a text such as 'kvzip:keep=0.3', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    if name not in EDITS:
        raise InvalidInputError(f"unknown edit {name!r}; known edits: {', '.join(sorted(EDITS))}")
    version, known = EDITS[name].version, EDITS[name].params
    values = {k: default for k, (default, _, _) in known.items()}
    given = set()
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if key not in known or not eq:
            raise InvalidInputError(f"edit {name}: unknown parameter {item!r}; parameters: {', '.join(known)}")
        if key in given:
            raise InvalidInputError(f"edit {name}: {key} is given twice in {spec!r}")
        given.add(key)
        try:
            number = float(value)
        except ValueError:
            raise InvalidInputError(f"edit {name}: {key} must be a number, got {value!r}") from None
        if not known[key][1](number):
            raise InvalidInputError(f"edit {name}: {key} must be {known[key][2]}, got {value}")
        values[key] = number
    return Edit(name, version, tuple(sorted((k, float(v)) for k, v in values.items())))


def parse_many(edits) -> list[Edit]:
    """A list of edits from one spec or a sequence of specs."""
    if edits is None:
        return []
    return [parse(e) for e in ([edits] if isinstance(edits, (str, Edit)) else edits)]


from kdn.edits import kinds  # noqa: E402,F401  (registers kvzip and steer)
