"""Tenants share tiers, never KV: a namespace (config or per call) or a secret is part of every
key's root, so across tenants there are no hits and no lookup membership, nobody blocks anybody's
store, and within a tenant every hit is exact (issue 46)."""

import random

import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig

CHUNK = 8


def test_100_mixed_requests_share_kv_only_within_their_tenant(tiny_llama, tmp_path, redis_server):
    """Seven tenants on one disk directory and one Redis: no namespace, two config namespaces, two
    secrets, and two per-call namespaces inside the plain config (a per-call "x", a name a client may
    choose, is not the config namespace "x": issue 62). Each request's lookup is exactly what its own
    tenant stored before (0 for a document only other tenants stored), and its answer is a full
    prefill's."""
    shared = dict(chunk_size=CHUNK, disk_dir=str(tmp_path / "disk"), remote_url=redis_server.url)
    plain = KDN(KDNConfig(**shared))
    plain.remote.clear()
    faces = {"plain": (plain, None), "call-x": (plain, "x"), "call-y": (plain, "y"),
             "ns-a": (KDN(KDNConfig(**shared, namespace="a")), None),
             "ns-x": (KDN(KDNConfig(**shared, namespace="x")), None),
             "secret-1": (KDN(KDNConfig(**shared, secret="first secret")), None),
             "secret-2": (KDN(KDNConfig(**shared, secret="second secret")), None)}
    docs = [random_ids(tiny_llama, 4 * CHUNK + 2 + i, seed=100 + i) for i in range(5)]
    answers = [tiny_llama.generate(d, max_new_tokens=2, do_sample=False) for d in docs]
    rng = random.Random(7)
    stored, cross = set(), 0
    for _ in range(100):
        tenant, d = rng.choice(sorted(faces)), rng.randrange(len(docs))
        cache, namespace = faces[tenant]
        expected = 4 * CHUNK if (tenant, d) in stored else 0
        found = cache.lookup(tiny_llama, docs[d], namespace=namespace)
        cross += found > expected
        assert found == expected, (tenant, d, found, expected)
        out = cache.generate(tiny_llama, docs[d], max_new_tokens=2, do_sample=False, namespace=namespace)
        assert torch.equal(out, answers[d])
        assert cache.last_generate["hit_tokens"] == expected
        cache.flush()
        stored.add((tenant, d))
    assert cross == 0 and len({t for t, _ in stored}) == len(faces)


def test_a_tenants_hit_is_exact_from_a_new_process_on_the_shared_store(tiny_llama, redis_server):
    """A new reader of the same tenant (the remote tier only) gets a full prefill's logits; another
    secret's reader of the same prompt misses, stores its own, and is then served exactly too."""
    ids = random_ids(tiny_llama, 3 * CHUNK + 1, seed=9)
    reference, cache = full_prefill(tiny_llama, ids)
    for secret in ("first secret", "second secret"):
        config = KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url, secret=secret, namespace="docs")
        writer = KDN(config)
        assert writer.lookup(tiny_llama, ids) == 0  # the first secret's stores are not seen, nor in the way
        writer.store(tiny_llama, ids, cache)
        writer.flush()
        kv, hit = KDN(config).retrieve(tiny_llama, ids)
        assert hit == 3 * CHUNK
        with torch.inference_mode():
            logits = tiny_llama(ids[:, hit:], past_key_values=kv).logits[0, -1]
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_a_name_a_client_chooses_never_reaches_a_config_namespace(tiny_llama, tmp_path):
    """Issue 62: a per-call namespace (a vLLM ``cache_salt``, chosen by the client) lives under a root
    no config namespace shares, with a secret or without: a client naming "acme" is not served what a
    process configured with ``namespace="acme"`` stored; inside a config namespace, per-call tenants
    nest (its "acme" is not the plain config's "acme")."""
    ids = random_ids(tiny_llama, 4 * CHUNK + 1, seed=31)
    for secret in (None, "the operator's secret"):
        shared = dict(chunk_size=CHUNK, disk_dir=str(tmp_path / f"disk-{secret is None}"), secret=secret)
        configured = KDN(KDNConfig(**shared, namespace="acme"))
        configured.generate(tiny_llama, ids, max_new_tokens=1, do_sample=False)
        configured.flush()
        assert configured.lookup(tiny_llama, ids) == 4 * CHUNK
        plain = KDN(KDNConfig(**shared))
        assert plain.lookup(tiny_llama, ids, namespace="acme") == 0
        plain.generate(tiny_llama, ids, max_new_tokens=1, do_sample=False, namespace="acme")
        plain.flush()
        assert plain.lookup(tiny_llama, ids, namespace="acme") == 4 * CHUNK
        assert configured.lookup(tiny_llama, ids, namespace="acme") == 0  # nested: another tenant


@pytest.mark.parametrize("bad", ["", 7, "x" * 1025, ["x"], "bad \udc80 surrogate"])
def test_a_namespace_is_a_short_non_empty_string(tiny_llama, bad):
    with pytest.raises(InvalidInputError, match="namespace"):
        KDNConfig(namespace=bad)
    with pytest.raises(InvalidInputError, match="namespace"):
        KDN(KDNConfig(chunk_size=CHUNK)).lookup(tiny_llama, random_ids(tiny_llama, 20), namespace=bad)


def test_encrypted_values_read_back_exactly_and_tell_the_store_nothing(tiny_llama, redis_server):
    """``encrypt=True``: what the store holds is ciphertext (no 32-byte run of the chunk's KV bytes
    appears in it), a reader with the secret is served a full prefill's logits (values split into
    parts too), and a value moved under another chunk's name does not decrypt (a corrupt miss)."""
    ids = random_ids(tiny_llama, 3 * CHUNK + 1, seed=21)
    reference, cache = full_prefill(tiny_llama, ids)
    config = KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url, secret="tenant secret", encrypt=True,
                       remote_part_bytes=4096)
    writer = KDN(config)
    writer.remote.clear()
    writer.store(tiny_llama, ids, cache)
    writer.flush()
    keys = writer.chunk_keys(tiny_llama, ids)
    plain = bytes(writer.memory.get(keys[0]))
    stored = b"".join(bytes(v) for v in writer.remote.transport.get(
        [writer.remote.redis_key(keys[0])] + [f"{writer.remote.redis_key(keys[0])}:p{i}" for i in range(1, 5)]) if v)
    payload = plain[len(plain) // 2:]
    assert len(stored) > len(plain) // 2
    assert not any(payload[i:i + 32] in stored for i in range(0, len(payload) - 32, 32))

    reader = KDN(config)
    kv, hit = reader.retrieve(tiny_llama, ids)
    assert hit == 3 * CHUNK
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)

    moved = KDN(config)  # the second chunk's value copied under the first's name (parts and all)
    tier = moved.remote
    first, second = tier.redis_key(keys[0]), tier.redis_key(keys[1])
    names = [second] + [f"{second}:p{i}" for i in range(1, 5)]
    tier.transport.put([(n.replace(second, first), v) for n, v in zip(names, tier.transport.get(names)) if v], None)
    assert moved.retrieve(tiny_llama, ids)[1] == 0 and tier.stats()["corrupt"] == 1


def test_an_encrypted_and_a_tagged_store_of_one_secret_never_share_a_name(tiny_llama, redis_server):
    """The same secret with and without ``encrypt``: two formats of value, so two sets of names (a
    tagged writer's values would not decrypt, and a sealed writer must not be blocked by them)."""
    ids = random_ids(tiny_llama, 2 * CHUNK + 1, seed=22)
    cache = full_prefill(tiny_llama, ids)[1]
    for encrypt in (False, True):
        config = KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url, secret="one secret", encrypt=encrypt)
        writer = KDN(config)
        assert writer.lookup(tiny_llama, ids) == 0
        writer.store(tiny_llama, ids, cache)
        writer.flush()
        assert KDN(config).retrieve(tiny_llama, ids)[1] == 2 * CHUNK


def test_encrypt_needs_a_secret():
    with pytest.raises(InvalidInputError, match="encrypt=True needs a secret"):
        KDNConfig(encrypt=True)
