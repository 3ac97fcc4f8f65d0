"""A remote store is a transport: one registered under its own URL scheme (a dict here, shared
like a server) serves a KDN's remote tier end to end, exactly, and delivery reads byte ranges only
from a transport that says it can."""

import collections

import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.storage import transport
from kdn.storage.transport import RemoteTransport, register

CHUNK = 8


@register
class DictTransport(RemoteTransport):
    """Values in a process-wide dict per URL; ``?ranges=0`` takes away byte ranges."""

    schemes = ("kdntest",)
    stores: dict = {}

    def __init__(self, url: str, timeout: float):
        self.values = self.stores.setdefault(url.split("?")[0], {})
        self.supports_ranges = not url.endswith("?ranges=0")
        self.calls = collections.Counter()

    def ping(self):
        self.calls["ping"] += 1

    def exists(self, names):
        self.calls["exists"] += 1
        return [n in self.values for n in names]

    def get(self, names):
        self.calls["get"] += 1
        return [self.values.get(n) for n in names]

    def get_ranges(self, requests):
        assert self.supports_ranges, "asked for byte ranges it cannot read"
        self.calls["get_ranges"] += 1
        out = []
        for name, start, end in requests:
            value = self.values.get(name, b"")
            start, end = (start % len(value), end % len(value)) if value else (0, -1)
            out.append(value[start:end + 1])
        return out

    def put(self, items, ttl_ms):
        self.calls["put"] += 1
        self.values.update((name, bytes(value)) for name, value in items)

    def delete(self, names):
        return sum(self.values.pop(n, None) is not None for n in names)

    def scan(self, pattern):
        prefix = pattern.split("*")[0].replace("{", "")
        return [n for n in list(self.values) if n.replace("{", "").startswith(prefix)]


def test_the_scheme_is_known_where_tiers_are_built_once_registered():
    assert "kdntest" in transport.schemes() and "redis" in transport.schemes()
    assert KDN(KDNConfig(remote_url="kdntest://a")).remote is not None
    with pytest.raises(InvalidInputError, match="kdntest"):  # the message lists every registered scheme
        KDN(KDNConfig(remote_url="nosuch://a"))
    with pytest.raises(InvalidInputError, match="remote_url"):
        KDNConfig(remote_url="127.0.0.1:6379")


@pytest.mark.parametrize("ranges", [True, False])
def test_a_registered_transport_serves_exact_kv_whole_or_in_ranges(tiny_llama, ranges):
    url = f"kdntest://shared-{ranges}" + ("" if ranges else "?ranges=0")
    ids = random_ids(tiny_llama, 41, seed=3)
    reference, cache = full_prefill(tiny_llama, ids)
    writer = KDN(KDNConfig(chunk_size=CHUNK, remote_url=url))
    writer.store(tiny_llama, ids, cache)
    writer.flush()
    assert len(DictTransport.stores[url.split("?")[0]]) == 5  # 40 tokens = 5 whole chunks

    reader = KDN(KDNConfig(chunk_size=CHUNK, remote_url=url))  # empty memory: every hit is remote
    got, hit = reader.retrieve(tiny_llama, ids, limit=40)
    stream = reader.last_retrieve.get("stream")
    if stream is not None:
        stream.wait_all()
    assert hit == 40 and reader.stats()["remote"]["hits"] == 5
    assert (reader.remote.transport.calls["get_ranges"] > 0) == ranges  # layer-wise only where ranges exist
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=got).logits[0, -1]
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
