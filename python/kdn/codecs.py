"""KV codecs by name: ``raw``, ``lossless``, ``int8``/``int4``/``int2`` (KIVI), ``cachegen`` and ``kvtc``.

A codec spec is a name with optional parameters: ``"int4"``, ``"int4:group=64"``,
``"cachegen"`` (level 2), ``"cachegen:level=3"``, ``"cachegen:level=2,anchor=1"``. Blobs carry
their codec id and parameters in their header, so a reader never needs to be told which codec
wrote a blob; each tier encodes what it stores with its own codec (``KDNConfig.memory_codec``,
``disk_codec``, ``remote_codec``).

============  =====================================================================  ============
codec         what it does                                                           exact?
============  =====================================================================  ============
raw           the canonical bytes                                                    yes
lossless      byte planes, each rANS-coded under its own order-0 table               bit-exact
int8/4/2      KIVI: keys per channel over ``group`` tokens, values per token over     no
              ``group`` channels; asymmetric, fp16 scale and zero (default group 32)
cachegen      per-channel normalization, per-token-vector quantization (finer steps    no
              for keys and for the shallow layers), rANS under per-(K/V, layer,
              channel) Laplace models; ``level`` 1 (smallest) to 3 (most accurate),
              ``anchor=1`` codes tokens as deltas to their group's first token
kvtc          transform coding under a per-model calibration (:mod:`kdn.kvtc`):      no
              PCA per plane, steps per component allocated by dynamic programming,
              rANS; ``ratio`` (default 8) is the calibrated size vs fp16, tokens at
              positions below ``sink`` (4) and each chunk's last ``recent`` (0) exact;
              a chunk whose calibration is not loaded is a miss
============  =====================================================================  ============

Example:
    >>> from kdn import codecs
    >>> cache = kdn.KDN(kdn.KDNConfig(chunk_size=16))
    >>> stored = cache.store(model, ids, model(ids, use_cache=True).past_key_values)
    >>> blob = cache.memory.get(cache.chunk_keys(model, ids)[0])   # a stored chunk, as a tier holds it
    >>> coded = codecs.encode(blob, "cachegen:level=3")     # any kdn blob, any codec
    >>> codecs.codec_of(coded).spec
    'cachegen:level=3'
    >>> kv = codecs.decode(coded)      # [layers, 2, tokens, kv_heads, head_dim]
    >>> tuple(kv.shape), len(coded) < len(blob)
    ((5, 2, 16, 4, 8), True)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Protocol

import torch

from kdn import _core
from kdn._core import InvalidInputError


@dataclasses.dataclass(frozen=True)
class _Kind:
    """One spec name of a codec in the C++ table (``_core.codec_table``, kCodecs in
    csrc/include/kdn/codec.h): the id in blob headers, the header params' fields ``(option, shift,
    bits, default)``, whether decoding is exact, and whether the name spells the first field's value
    (KIVI's ``int4``: bits 4)."""

    id: int
    name: str  # the codec's name in the table ("int" for every KIVI width)
    lossy: bool
    device_decoded: bool
    calibrated: bool = False  # codes under per-model state (:class:`ModelState`, ``kdn.<name>.STATE``)
    fields: tuple = ()
    spelled: int | None = None  # the first field's value when the spec name gives it

    @property
    def options(self) -> dict:
        """The options a spec may set, with their defaults."""
        return {name: default for name, _, _, default in self.fields[self.spelled is not None:]}

    def pack(self, options: dict) -> int:
        values = {**({self.fields[0][0]: self.spelled} if self.spelled is not None else {}), **options}
        return sum(values[name] << shift for name, shift, _, _ in self.fields)

    def unpack(self, params: int) -> str:
        """The spec string of header ``params``, every option written out."""
        values = {name: params >> shift & (1 << bits) - 1 for name, shift, bits, _ in self.fields}
        head = self.name
        if self.spelled is not None:
            head += str(values.pop(self.fields[0][0]))
        return head + (":" + ",".join(f"{k}={v}" for k, v in values.items()) if values else "")


def _registry() -> dict[str, _Kind]:
    kinds = {"raw": _Kind(0, "raw", False, False)}
    for row in _core.codec_table():
        for spelling in row["spellings"].split():
            spelled = int(spelling[len(row["name"]):]) if spelling != row["name"] else None
            kinds[spelling] = _Kind(row["id"], row["name"], row["lossy"], row["device_decoded"],
                                    row["calibrated"], tuple(tuple(o) for o in row["options"]), spelled)
    return kinds


_KINDS = _registry()
NAMES = tuple(_KINDS)
_BY_ID = {kind.id: kind for kind in reversed(_KINDS.values())}  # a KIVI blob's width comes from its params
DEVICE_DECODED = frozenset(kind.id for kind in _KINDS.values() if kind.device_decoded)


class ModelState(Protocol):
    """Per-model state a calibrated codec codes with (kvtc's calibration), filed in the tiers beside
    the chunks so that every process that meets the model decodes them: where it is filed
    (``key(fingerprint)``), which state a blob needs (``needed(blob)``: an id, or None; BlobError for
    a damaged blob), whether that one is loaded here, loading it from its stored blob or from its
    payload (``load``: its id), the blob that files a payload (``pack``), and its fit on a model's
    contexts (``calibrate(model, contexts, **options)``: the payload). A calibrated codec's module
    ``kdn.<name>`` holds it as ``STATE``."""

    def key(self, fingerprint: bytes) -> bytes: ...
    def needed(self, blob) -> bytes | None: ...
    def loaded(self, state_id: bytes) -> bool: ...
    def load_blob(self, blob, fingerprint: bytes, key: bytes) -> None: ...
    def load(self, payload: bytes) -> bytes: ...
    def pack(self, fingerprint: bytes, key: bytes, payload: bytes) -> bytes: ...
    def calibrate(self, model, contexts, **options) -> bytes: ...


@functools.cache
def model_states() -> dict[str, ModelState]:
    """The calibrated codecs' per-model states, by codec name."""
    names = dict.fromkeys(kind.name for kind in _KINDS.values() if kind.calibrated)
    return {name: importlib.import_module(f"kdn.{name}").STATE for name in names}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Codec:
    """A parsed codec spec: its name, options, and the (id, params) written into blob headers."""

    name: str
    options: tuple = ()

    @property
    def id(self) -> int:
        return _KINDS[self.name].id

    @property
    def params(self) -> int:
        return _KINDS[self.name].pack(dict(self.options))

    @property
    def lossy(self) -> bool:
        """True for int*, cachegen and kvtc: decoding does not give back the exact KV."""
        return _KINDS[self.name].lossy

    @property
    def spec(self) -> str:
        """The canonical spec string: defaults left out, so equal codecs have equal specs."""
        defaults = _KINDS[self.name].options
        changed = [f"{k}={v}" for k, v in self.options if v != defaults[k]]
        return self.name + (":" + ",".join(changed) if changed else "")

    def __str__(self) -> str:
        return self.spec


def parse(spec) -> Codec:
    """A :class:`Codec` from a spec string (or a Codec). Raises InvalidInputError with the choices."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise InvalidInputError(f"codec spec must be a string such as 'int4' or 'cachegen:level=3', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    if name not in _KINDS:
        raise InvalidInputError(f"unknown codec {name!r}; choose one of {', '.join(NAMES)}")
    kind = _KINDS[name]
    options = dict(kind.options)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if key not in options or not eq:
            known = ", ".join(f"{k}=<int>" for k in options) or "none"
            raise InvalidInputError(f"codec {name!r}: bad option {item!r} (options: {known})")
        try:
            options[key] = int(value)
        except ValueError:
            raise InvalidInputError(f"codec {name!r}: option {key} must be an integer, got {value!r}") from None
        if not 0 <= options[key] < 1 << next(bits for k, _, bits, _ in kind.fields if k == key):
            raise InvalidInputError(f"codec {name!r}: option {key}={options[key]} is out of range")
    codec = Codec(name, tuple(options.items()))
    if codec.id:
        _core.codec_check(codec.id, codec.params)
    return codec


def codec_of(blob) -> Codec:
    """The codec a blob was written with (from its header)."""
    h = _core.blob_parse(blob, verify_checksum=False)
    kind = _BY_ID.get(h["codec"])
    if kind is None:
        raise InvalidInputError(f"blob written with codec id {h['codec']}, which this kdn does not know")
    return parse(kind.unpack(h["codec_params"]))


def address(key: bytes, codec) -> bytes:
    """Where a chunk of ``key`` coded with ``codec`` is filed: ``key`` for exact codecs, else its
    lossy key (a hash of key, codec and parameters), so lossy KV never answers an exact lookup."""
    c = parse(codec)
    return _core.lossy_key(key, c.id, c.params)


def key_of(blob) -> bytes:
    """The chunk key in a blob's header (its address: lossy blobs carry their lossy key)."""
    return _core.blob_parse(blob, verify_checksum=False)["key"]


def stored_key(blob, codec) -> bytes:
    """The key ``blob`` carries once coded with ``codec`` (what :func:`encode` gives it): its own
    key unless ``codec`` is lossy and not already the blob's codec."""
    c = parse(codec)
    return _core.coded_key(blob, c.id, c.params)


def encode(blob, codec, report: bool = False):
    """``blob`` re-coded with ``codec`` (a spec or Codec): the same object if it already is.

    With ``report=True`` returns ``(blob, report)``, the coder's accounting: entropy-coded
    ``symbols``, ``model_bits`` (their cost under the codec's own model), ``empirical_bits``
    (under each context's empirical frequencies), ``coded_bytes``, ``table_bytes``, ``side_bytes``.
    """
    c = parse(codec)
    return _core.transcode(blob, c.id, c.params, report)


def decode(blob) -> torch.Tensor:
    """The chunk of a blob (any codec) as a CPU tensor ``[layers, 2, tokens, kv_heads, head_dim]``."""
    raw = _core.transcode(blob, 0, 0)
    h = _core.blob_parse(raw, verify_checksum=False)
    shape = (h["layers"], 2, h["tokens"], h["kv_heads"], h["head_dim"])
    payload = memoryview(raw)[80:80 + h["payload_bytes"]]
    return torch.frombuffer(bytearray(payload), dtype=_DTYPES[h["dtype"]]).view(shape)
