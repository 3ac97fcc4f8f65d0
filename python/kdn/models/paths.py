"""Where data files come from: $KDN_DATA, $KDN_SHARED/data (default ../shared), and installed wheels."""

from __future__ import annotations

import os
from pathlib import Path


class ModelNotAvailableError(RuntimeError):
    """A model's files are not on this machine; the message says how to get them."""


def shared_dir() -> Path:
    """The shared folder: ``$KDN_SHARED`` if set, else ``../shared`` from the working directory."""
    return Path(os.environ.get("KDN_SHARED", "../shared")).expanduser().resolve()


def data_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Folders searched for evaluation data, in order: ``data_dir`` if given (and then only it),
    else ``$KDN_DATA`` (if set), then ``$KDN_SHARED/data`` (default ``../shared/data``), then the
    slices a clone of kdn ships, ``tests/data`` (from the clone's root) or ``../tests/data`` (from
    its ``notebooks/``), so a bare clone's examples find data."""
    if data_dir is not None:
        return [Path(data_dir).expanduser().resolve()]
    dirs = [Path(os.environ["KDN_DATA"]).expanduser().resolve()] if os.environ.get("KDN_DATA") else []
    slices = [p.resolve() for p in (Path("tests/data"), Path("../tests/data")) if p.is_dir()]
    return dirs + [shared_dir() / "data"] + slices
