"""Hashes and chunk keys against reference implementations (pip blake3 / xxhash) and across processes."""

import os
import subprocess
import sys

import blake3
import numpy as np
import pytest
import xxhash

from kdn import _core

SIZES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 2049, 3 * 1024 + 7, 1 << 16, (1 << 20) + 3]


@pytest.mark.parametrize("size", SIZES)
def test_blake3_matches_reference(size):
    data = os.urandom(size)
    assert _core.blake3(data) == blake3.blake3(data).digest()
    assert _core.blake3(data, 131) == blake3.blake3(data).digest(131)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("seed", [0, 7, 2**63 + 5])
def test_xxh64_matches_reference(size, seed):
    data = os.urandom(size)
    assert _core.xxh64(data, seed) == xxhash.xxh64(data, seed=seed).intdigest()


def reference_prefix_keys(fingerprint: bytes, tokens: np.ndarray, chunk: int, partial=False) -> list[bytes]:
    keys, parent = [], bytes(16)
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        if len(part) < chunk and not partial:
            break
        message = b"kdn/prefix" + (1).to_bytes(4, "little") + fingerprint + parent + part.astype("<u4").tobytes()
        parent = blake3.blake3(message).digest(16)
        keys.append(parent)
    return keys


@pytest.mark.parametrize("n,chunk", [(0, 4), (3, 4), (8, 4), (1000, 256), (1024, 256), (77, 1)])
@pytest.mark.parametrize("partial", [False, True])
def test_prefix_keys_match_reference(n, chunk, partial):
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, 50000, n).astype(np.uint32)
    fp = os.urandom(16)
    assert _core.prefix_chunk_keys(fp, tokens, chunk, partial) == reference_prefix_keys(fp, tokens, chunk, partial)


def test_prefix_keys_are_chained_and_model_specific():
    tokens = np.arange(1024, dtype=np.uint32)
    fp_a, fp_b = bytes(16), b"\x01" * 16
    keys = _core.prefix_chunk_keys(fp_a, tokens, 256)
    changed = tokens.copy()
    changed[3] += 1  # a change in chunk 0 changes every later key
    assert all(a != b for a, b in zip(keys, _core.prefix_chunk_keys(fp_a, changed, 256)))
    later = tokens.copy()
    later[600] += 1  # a change in chunk 2 keeps keys 0 and 1
    k2 = _core.prefix_chunk_keys(fp_a, later, 256)
    assert k2[:2] == keys[:2] and k2[2] != keys[2] and k2[3] != keys[3]
    assert set(keys).isdisjoint(_core.prefix_chunk_keys(fp_b, tokens, 256))


def test_keys_are_identical_in_another_process():
    code = (
        "import numpy as np; from kdn import _core; "
        "print(b''.join(_core.prefix_chunk_keys(bytes(range(16)), np.arange(600, dtype=np.uint32), 128)).hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    here = b"".join(_core.prefix_chunk_keys(bytes(range(16)), np.arange(600, dtype=np.uint32), 128)).hex()
    assert other == here


def test_bad_key_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="fingerprint must be 16 bytes"):
        _core.prefix_chunk_keys(b"short", np.arange(4, dtype=np.uint32), 2)
    with pytest.raises(ValueError, match="uint32"):
        _core.prefix_chunk_keys(bytes(16), np.arange(4, dtype=np.int64), 2)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        _core.prefix_chunk_keys(bytes(16), np.arange(4, dtype=np.uint32), 0)
