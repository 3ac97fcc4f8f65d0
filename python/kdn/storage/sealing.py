"""Values at rest sealed with AES-256-GCM (``KDNConfig.encrypt``): what a remote store's operator cannot read."""

from __future__ import annotations

import os

from kdn import _core
from kdn._core import InvalidInputError


class Sealer:
    """AES-256-GCM for values at rest: a key per chunk (BLAKE3 keyed by the secret's key over the
    chunk's key), a random 96-bit nonce per value (stored before the ciphertext), the value's name as
    associated data. Nothing of the key is ever logged."""

    NONCE = 12

    def __init__(self, mac_key: bytes):
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise InvalidInputError("encrypt=True needs the cryptography package: pip install 'kdn[crypto]'") from None
        if not mac_key:
            raise InvalidInputError("encrypt=True needs a secret (its keys derive from it)")
        self._aead, self._master = AESGCM, _core.blake3(b"kdn/encrypt\0" + mac_key, 32)

    def _cipher(self, key: bytes):
        return self._aead(_core.blake3(key, 32, key=self._master))

    def seal(self, key: bytes, name: str, data) -> bytes:
        nonce = os.urandom(self.NONCE)
        return nonce + self._cipher(key).encrypt(nonce, data, name.encode())

    def open(self, key: bytes, name: str, value):
        """The plaintext of a sealed ``value`` (bytes, or the list of its parts), or None."""
        from cryptography.exceptions import InvalidTag

        data = _core.buffer_join(value) if isinstance(value, list) else value
        view = memoryview(data).cast("B")
        if len(view) <= self.NONCE + 16:
            return None
        cipher, nonce, sealed, aad = self._cipher(key), view[:self.NONCE], view[self.NONCE:], name.encode()
        try:
            if not hasattr(cipher, "decrypt_into"):  # cryptography < 44
                return cipher.decrypt(nonce, sealed, aad)
            out = _core.Buffer.empty(len(sealed) - 16)  # the plaintext straight into a Buffer: no copy
            with memoryview(out) as target:
                cipher.decrypt_into(nonce, sealed, aad, target)
            out.freeze()
            return out
        except InvalidTag:
            return None
