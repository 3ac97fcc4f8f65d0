"""KDNConfig from code, YAML and KDN_* variables: sizes, choices and readable errors."""

import pytest

from kdn import InvalidInputError, KDNConfig
from kdn.config import GiB, MiB, default_cache_dir, parse_bytes


@pytest.mark.parametrize("text, expected", [("1048576", 1 << 20), ("512MiB", 512 * MiB), ("4 GB", 4 * 10**9),
                                            ("1.5GiB", int(1.5 * GiB)), ("1_000", 1000), (7, 7)])
def test_byte_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "5 parsecs", "", None, 1.5, True])
def test_bad_byte_sizes_name_the_setting(bad):
    with pytest.raises(InvalidInputError, match="memory_bytes"):
        KDNConfig(memory_bytes=bad)


def test_defaults_keep_the_disk_tier_off():
    config = KDNConfig()
    assert config.disk_dir is None and config.memory_policy == "lru" and config.write_policy == "write-through"


def test_yaml_then_env_then_keywords(tmp_path, monkeypatch):
    path = tmp_path / "kdn.yaml"
    path.write_text("kdn:\n  chunk_size: 64\n  memory_bytes: 1GiB\n  disk_dir: ~/kdn-cache\n  memory_policy: s3fifo\n")
    monkeypatch.setenv("KDN_MEMORY_BYTES", "2GiB")
    monkeypatch.setenv("KDN_DISK_FSYNC", "off")
    config = KDNConfig.load(path, chunk_size=128)
    assert (config.chunk_size, config.memory_bytes, config.memory_policy, config.disk_fsync) == (128, 2 * GiB,
                                                                                                  "s3fifo", False)
    assert config.disk_dir.endswith("kdn-cache") and "~" not in config.disk_dir
    assert KDNConfig.from_yaml(path).memory_bytes == GiB
    monkeypatch.setenv("KDN_CONFIG", str(path))
    assert KDNConfig.load().chunk_size == 64


def test_auto_disk_dir_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert KDNConfig(disk_dir="auto").disk_dir == str(tmp_path / "kdn") == str(default_cache_dir())
    monkeypatch.setenv("KDN_DISK_DIR", "none")
    assert KDNConfig.from_env().disk_dir is None


def test_readable_errors(tmp_path, monkeypatch):
    path = tmp_path / "kdn.yaml"
    path.write_text("memory_byte: 1GiB\n")
    with pytest.raises(InvalidInputError, match="unknown kdn setting 'memory_byte'.*did you mean 'memory_bytes'"):
        KDNConfig.from_yaml(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(InvalidInputError, match="must hold a mapping"):
        KDNConfig.from_yaml(path)
    path.write_text("chunk_size: [1\n")
    with pytest.raises(InvalidInputError, match="not valid YAML"):
        KDNConfig.from_yaml(path)
    with pytest.raises(InvalidInputError, match="cannot read kdn config file"):
        KDNConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(InvalidInputError, match="write_policy='write-around'; choose one of memory-only"):
        KDNConfig(write_policy="write-around")
    with pytest.raises(InvalidInputError, match="memory_policy"):
        KDNConfig(memory_policy="arc")
    monkeypatch.setenv("KDN_DISK_FSYNC", "maybe")
    with pytest.raises(InvalidInputError, match="KDN_DISK_FSYNC='maybe' is not a boolean"):
        KDNConfig.from_env()
