"""kdn: a Knowledge Delivery Network that stores, delivers and blends LLM KV caches.

Example:
    >>> import kdn
    >>> model, tokenizer = kdn.models.load("stories260k")
    >>> cache = kdn.KDN()
    >>> ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    >>> out = cache.generate(model, ids, max_new_tokens=8)   # full prefill, then stored
    >>> out = cache.generate(model, ids, max_new_tokens=8)   # prefix served from kdn
"""

from importlib.metadata import PackageNotFoundError, version

from kdn._core import BlobError, InvalidInputError, KDNError
from kdn.config import KDNConfig
from kdn.integrations.hf import KDN

try:  # the version lives in pyproject.toml only
    __version__ = version("kdn")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["KDN", "KDNConfig", "KDNError", "InvalidInputError", "BlobError", "__version__"]


def __getattr__(name):  # lazy: `kdn.models` imports transformers model code
    if name == "models":
        import kdn.models as models

        return models
    raise AttributeError(name)
