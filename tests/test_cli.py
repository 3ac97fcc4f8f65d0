"""The command line: `kdn info`, `python -m kdn.info`, and argument errors."""

import subprocess
import sys

import pytest

from kdn import _core
from kdn.cli import main


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
