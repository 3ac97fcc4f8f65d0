"""Where model files come from: $KDN_SHARED (default ../shared) and installed wheels."""

from __future__ import annotations

import os
from pathlib import Path


class ModelNotAvailableError(RuntimeError):
    """A model's files are not on this machine; the message says how to get them."""


def shared_dir() -> Path:
    """The shared data folder: ``$KDN_SHARED`` if set, else ``../shared`` from the working directory."""
    return Path(os.environ.get("KDN_SHARED", "../shared")).expanduser().resolve()
