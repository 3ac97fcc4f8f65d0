"""The notebooks run top to bottom (nbclient, real kernel) on the small model, so they never rot."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def outputs_text(nb) -> str:
    return "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                     + str(o.get("data", {}).get("text/markdown", ""))
                     for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    # the kernel runs in tmp_path and inherits KDN_DATA (conftest: the slices in tests/data)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = outputs_text(nb)
    if path.name == "quickstart.ipynb":
        assert "answers identical to a full prefill: True" in text and "served from kdn" in text
    else:
        assert "| reuse |" in text and "| blend@0.15 |" in text


def test_both_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["evaluation.ipynb", "quickstart.ipynb"]
