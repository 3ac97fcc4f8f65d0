"""Text bundled with kdn: the demo's invented city guide (``velmora.txt``)."""

import importlib.resources


def velmora() -> str:
    """The bundled demo document (an invented city guide, ~2,900 SmolLM2 tokens)."""
    return importlib.resources.files("kdn.data").joinpath("velmora.txt").read_text(encoding="utf-8")
