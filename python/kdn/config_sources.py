"""Where kdn's settings come from besides code: byte sizes written as text, ``KDN_*`` environment
variables and YAML files, each value parsed and each unknown name refused with a "did you mean"."""

from __future__ import annotations

import difflib
import json
import os
import re
import warnings
from fractions import Fraction
from pathlib import Path

from kdn._core import InvalidInputError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": KiB, "m": 1000**2, "mb": 1000**2, "mib": MiB,
          "g": 1000**3, "gb": 1000**3, "gib": GiB, "t": 1000**4, "tb": 1000**4, "tib": TiB}
SIZE_FIELDS = ("memory_bytes", "node_bytes", "disk_bytes", "disk_queue_bytes", "remote_part_bytes",
               "remote_queue_bytes")
INT_FIELDS = ("chunk_size", "disk_read_threads", "layer_group")
SECONDS_FIELDS = ("remote_timeout", "remote_ttl", "remote_retry_seconds", "ttft_deadline", "retain_max_seconds")
FRACTION_FIELDS = ("verify_fraction", "retain_fraction")
OPTIONAL_SECONDS = ("remote_ttl", "ttft_deadline")
BOOL_FIELDS = ("disk_fsync", "disk_shared", "encrypt", "pin_host_memory")
# the least a setting may be: below it a value is a typo, or stops kdn from doing its work
MIN_SECONDS = {"remote_timeout": 0.001, "remote_retry_seconds": 0.05}
MIN_BYTES = {"remote_part_bytes": 1024}
# KDN_ variables that are not settings: read by the package, its tests, benchmarks and CI scripts
# (tests/test_code_rules.py fails when one of those reads a KDN_ variable missing here).
OTHER_ENV = frozenset({
    "KDN_CONFIG", "KDN_SHARED", "KDN_DATA", "KDN_CUDA", "KDN_BUFFER_POOL_BYTES", "KDN_BUFFER_POOL_HUGE_PAGES",
    "KDN_REQUIRE_SERVERS", "KDN_REQUIRE_DATA", "KDN_REQUIRE_VLLM", "KDN_REQUIRE_QWEN", "KDN_VLLM_PYTHON",
    "KDN_VLLM_VENV", "KDN_APT_PACKAGES", "KDN_BENCH_DIR", "KDN_SGLANG_WHEEL", "KDN_SGLANG_PATH", "KDN_COSTS",
    "KDN_LMCACHE_SITE", "KDN_COMMIT", "KDN_VLLM_WHEEL", "KDN_COMPAT_RECORD", "KDN_COMPAT_KEEP",
    "KDN_ADMIN_TOKEN"})
_warned_env: set[str] = set()


MAX_TEXT_BYTES = 1 << 60  # a byte size written as text beyond 1 EiB is a typo


def parse_bytes(value, name: str = "size") -> int:
    """A byte count from an int or a string such as ``"512MiB"``, ``"4 GB"`` or ``"1_000"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and len(value) <= 64:
        m = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            number = Fraction(m.group(1).replace("_", "")) * _UNITS[m.group(2).lower()]  # exact, no overflow
            if number <= MAX_TEXT_BYTES:
                return int(number)
            raise InvalidInputError(f"{name}={value!r} is larger than 1 EiB; is it a typo?")
    raise InvalidInputError(f"{name}={value!r:.80} is not a byte size (examples: 1048576, '512MiB', '4GB')")


BOOLEAN_TEXT = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                "off": False}


def parse_bool(raw: str, where: str) -> bool:
    """A boolean written as text (1/0, true/false, yes/no, on/off)."""
    lowered = raw.strip().lower()
    if lowered not in BOOLEAN_TEXT:
        raise InvalidInputError(f"{where}={raw!r:.80} is not a boolean (true/false)")
    return BOOLEAN_TEXT[lowered]


def apply_process_env() -> None:
    """Check the process-wide ``KDN_BUFFER_POOL_*`` variables (read by the C++ buffer pool) and
    apply them: a byte size (``"512MiB"`` too) and a boolean; a bad value is an InvalidInputError
    (the pool alone would read ``garbage`` as 0 and ``-1`` as 2^64 - 1)."""
    from kdn import _core

    raw = os.environ.get("KDN_BUFFER_POOL_BYTES")
    if raw is not None:
        _core.buffer_pool_set_limit(parse_bytes(raw, "KDN_BUFFER_POOL_BYTES"))
    raw = os.environ.get("KDN_BUFFER_POOL_HUGE_PAGES")
    if raw is not None:
        _core.buffer_pool_huge_pages(parse_bool(raw, "KDN_BUFFER_POOL_HUGE_PAGES"))


def unknown(name: str, where: str, fields: list[str]) -> InvalidInputError:
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(fields)}"
    return InvalidInputError(f"unknown kdn setting {name!r} in {where}{hint}")


def env_values(fields: list[str]) -> dict:
    for var in os.environ:
        if var.startswith("KDN_") and var not in OTHER_ENV and var[4:].lower() not in fields \
                and var not in _warned_env:
            _warned_env.add(var)
            close = difflib.get_close_matches(var[4:].lower(), fields, n=1)
            hint = f"; did you mean KDN_{close[0].upper()}?" if close else ""
            warnings.warn(f"kdn: ignoring the unknown environment variable {var}{hint}", UserWarning, stacklevel=3)
    values = {}
    for name in fields:
        raw = os.environ.get(f"KDN_{name.upper()}")
        if raw is not None:
            values[name] = from_text(name, raw, f"KDN_{name.upper()}")
    return values


def from_text(name: str, raw: str, where: str):
    if name == "quotas":
        return quota_pairs(raw)
    if name == "remote_options":
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise InvalidInputError(f"{where}={raw!r} is not a JSON object of options") from None
    if name in INT_FIELDS or name == "probe_step":
        try:
            return int(raw)
        except ValueError:
            raise InvalidInputError(f"{where}={raw!r} is not an integer") from None
    if name in SIZE_FIELDS:
        return parse_bytes(raw, where)
    if name in BOOL_FIELDS:
        return parse_bool(raw, where)
    if name in FRACTION_FIELDS:
        try:
            return float(raw)
        except ValueError:
            raise InvalidInputError(f"{where}={raw!r} is not a number in [0, 1]") from None
    if name in SECONDS_FIELDS:
        if name in OPTIONAL_SECONDS and raw.strip().lower() in ("", "none", "off"):
            return None
        try:
            return float(raw)
        except ValueError:
            raise InvalidInputError(f"{where}={raw!r} is not a number of seconds") from None
    if name in ("disk_dir", "remote_url") and raw.strip().lower() in ("", "none", "off"):
        return None
    return raw


def yaml_values(path, fields: list[str]) -> dict:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidInputError(f"cannot read kdn config file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidInputError(f"kdn config file {path} is not valid YAML: {e}") from None
    data = data or {}
    if isinstance(data, dict) and set(data) == {"kdn"}:
        data = data["kdn"] or {}
    if not isinstance(data, dict):
        raise InvalidInputError(f"kdn config file {path} must hold a mapping of settings, got {type(data).__name__}")
    for name in data:
        if name not in fields:
            raise unknown(str(name), str(path), fields)
    return dict(data)


def check_namespace(namespace, what: str = "namespace") -> str:
    """``namespace`` if it is a usable tenant name (a non-empty string of at most 1024 characters,
    encodable as UTF-8: no lone surrogates)."""
    if not isinstance(namespace, str) or not 0 < len(namespace) <= 1024:
        raise InvalidInputError(f"{what} must be a non-empty string of at most 1024 characters (or None), "
                                f"got {namespace!r:.200}")
    try:
        namespace.encode()
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"{what} is not valid text ({e.reason} at position {e.start})") from None
    return namespace


def option_pairs(value) -> tuple:
    """Sorted ``(name, value)`` pairs from a mapping (or pairs): a config stays hashable."""
    if value is None:
        return ()
    try:
        pairs = sorted(dict(value).items())
    except (TypeError, ValueError):
        raise InvalidInputError(f"KDNConfig.remote_options must be a mapping of option names to values, "
                                f"got {value!r}") from None
    if not all(isinstance(name, str) for name, _ in pairs):
        raise InvalidInputError(f"KDNConfig.remote_options: option names are strings, got {[n for n, _ in pairs]}")
    return tuple(pairs)


def _fraction_or_size(text: str):
    """``"0.25"`` -> 0.25 (a fraction); anything else stays text (a byte size, parsed later)."""
    return float(text) if re.fullmatch(r"[0-9]*\.[0-9]+", text) else text


def quota_pairs(value) -> tuple:
    """Sorted ``(namespace, quota)`` pairs from a mapping (or pairs, or text ``"a=2GiB,b=0.25"`` / a JSON
    object): a quota is a fraction in (0, 1] of each local tier (a float) or a byte size."""
    where = "KDNConfig.quotas"
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError:
                raise InvalidInputError(f"{where}={value!r:.80} is not a JSON object of quotas") from None
        else:
            value = [part.split("=", 1) for part in text.split(",") if part.strip()]
            if not all(len(p) == 2 for p in value):
                raise InvalidInputError(f"{where}: write quotas as namespace=quota pairs ('a=2GiB,b=0.25'), "
                                        f"got {text!r:.80}")
            value = {name.strip(): _fraction_or_size(q.strip()) for name, q in value}
    try:
        pairs = sorted(dict(value).items())
    except (TypeError, ValueError):
        raise InvalidInputError(f"{where} must map tenant names to quotas, got {value!r:.80}") from None
    out = []
    for name, quota in pairs:
        check_namespace(name, f"{where} key")
        if isinstance(quota, float):
            if not 0 < quota <= 1:
                raise InvalidInputError(f"{where}[{name!r}]={quota!r}: a fraction of each tier in (0, 1], or a "
                                        "byte size such as '2GiB'")
        elif isinstance(quota, bool) or parse_bytes(quota, f"{where}[{name!r}]") <= 0:
            raise InvalidInputError(f"{where}[{name!r}]={quota!r}: a positive byte size or a fraction in (0, 1]")
        else:
            quota = parse_bytes(quota, f"{where}[{name!r}]")
        out.append((name, quota))
    return tuple(out)


def codec_list(name: str, value) -> tuple:
    """A tuple of canonical codec specs from a list or a comma-separated string."""
    from kdn import codecs

    if isinstance(value, str):
        value = [a for a in (s.strip() for s in value.split(",")) if a]
    if not isinstance(value, (list, tuple)):
        raise InvalidInputError(f"KDNConfig.{name} must be a list of codec specs, got {value!r}")
    try:
        return tuple(dict.fromkeys(codecs.parse(a).spec for a in value))
    except InvalidInputError as e:
        raise InvalidInputError(f"KDNConfig.{name}: {e}") from None
