"""What, beyond its tokens, a vLLM request's KV depends on, as kdn keys it: its ``cache_salt``, its
LoRA adapter (by the fingerprint of the adapter's files) and its multimodal inputs (their hashes
and positions); a request kdn cannot key (prompt embeddings, an adapter whose files it cannot read)
is served nothing and stores nothing. Everything vLLM puts in a block hash
(``vllm/v1/core/kv_cache_utils.py``) is here, and no request content makes this raise."""

from __future__ import annotations

import logging
import os
import threading

from kdn._core import KDNError
from kdn.integrations.vllm.vouch import missing_request_fields
from kdn.keys import adapter_fingerprint, request_scope

log = logging.getLogger("kdn")


class Unservable(Exception):
    """A request kdn cannot key: it is served nothing and stores nothing (``reason`` says why)."""


class Scopes:
    """The kdn scope (:func:`kdn.keys.request_scope`, 16 bytes, or None) of vLLM requests, with the
    fingerprints of the LoRA adapters they name, each computed once per version of its files
    (a ``load_inplace`` over new weights changes its size or modification time, and its scope)."""

    def __init__(self):
        self._adapters: dict[str, tuple[tuple, bytes]] = {}  # lora_path -> (files' stat, fingerprint)
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def of(self, request) -> bytes | None:
        """The scope of ``request`` (a vLLM ``Request``); raises :class:`Unservable`, never anything else."""
        try:
            missing = missing_request_fields(request)
            if missing:  # a vLLM that moved one: read as its default, tenants or inputs would share KV
                raise Unservable(f"vLLM's Request has no {', '.join(missing)} (kdn keys requests by them)")
            if getattr(request, "prompt_embeds", None) is not None:
                raise Unservable("a prompt given as embeddings (kdn keys token ids)")
            salt = getattr(request, "cache_salt", None) or None
            if salt is not None and not isinstance(salt, str):
                raise Unservable(f"a cache_salt of type {type(salt).__name__}")
            lora = getattr(request, "lora_request", None)
            adapter = self.adapter(lora) if lora else None
            return request_scope(salt, adapter, _inputs(getattr(request, "mm_features", None)))
        except Unservable:
            raise
        except Exception as e:  # noqa: BLE001 - request content must never reach vLLM as an exception
            raise Unservable(f"{type(e).__name__}: {e}") from None

    def adapter(self, lora) -> bytes:
        """The fingerprint of the adapter a ``LoRARequest`` names (its ``lora_path`` on this machine)."""
        path = getattr(lora, "lora_path", "") or ""
        if not path or not os.path.isdir(path):
            raise Unservable(f"LoRA adapter {getattr(lora, 'lora_name', '?')!r}: its path {path!r:.200} is not a "
                             "folder on this machine (kdn keys an adapter by its files)")
        try:
            signature = tuple(sorted((e.name, st.st_size, st.st_mtime_ns) for e in os.scandir(path)
                                     if e.is_file() for st in (e.stat(),)))
        except OSError as e:
            raise Unservable(f"LoRA adapter folder {path}: {e}") from None
        with self._lock:
            known = self._adapters.get(path)
        if known is not None and known[0] == signature:
            return known[1]
        try:
            fingerprint = adapter_fingerprint(path)
        except KDNError as e:
            raise Unservable(str(e)) from None
        with self._lock:
            if len(self._adapters) >= 1024:
                self._adapters.pop(next(iter(self._adapters)))
            self._adapters[path] = (signature, fingerprint)
        return fingerprint

    def warn_once(self, request_id: str, reason: str, outcome: str = "is served nothing and stores nothing") -> None:
        """Log, once per kind of reason, what kdn does with a request it cannot take as it is."""
        kind = reason.split(":", 1)[0][:80]
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("kdn: request %.200s %s: %s", request_id, outcome, reason)


def _inputs(features) -> bytes:
    """Canonical bytes of a request's multimodal inputs: each one's hash (vLLM's ``identifier``) and
    placeholder position, in order; b"" for none."""
    if not features:
        return b""
    parts = []
    for f in features:
        identifier = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        position = getattr(f, "mm_position", None)
        if not identifier or position is None:
            raise Unservable("a multimodal input without a hash or a position")
        parts.append(f"{getattr(f, 'modality', '')}|{identifier}|{int(position.offset)}|{int(position.length)}")
    return "\n".join(parts).encode("utf-8", "surrogatepass")
