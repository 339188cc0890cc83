"""Every notebook runs top to bottom in a fresh kernel and draws its figures; git holds them without outputs.

The kernel is ``python3``, the spec ipykernel installs into the virtualenv (jupyter_client starts it with this
interpreter), so a clean ``pip install -e '.[gpu,test]'`` needs no kernel registration.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIGURE_CALL = re.compile(r"\bplot_\w+\(")  # a call of one of viz's plot_* functions, not its import


def test_the_documented_notebooks_are_the_ones_here_and_each_draws():
    """docs/simulator.md's table of notebooks names every notebook here and no other (a notebook added without its
    line, or a line left after its notebook went, fails), and each notebook has a cell that draws a figure. An
    empty notebooks/ fails here instead of leaving the tests parametrized over it nothing to run."""
    documented = re.findall(r"^\| `(\w+)\.ipynb` \|", (ROOT / "docs" / "simulator.md").read_text(), flags=re.M)
    assert documented and sorted(documented) == [p.stem for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        assert any(c.cell_type == "code" and FIGURE_CALL.search(c.source) for c in cells), f"{path.name} draws nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws_figures(path):
    book = nbformat.read(path, as_version=4)
    # A notebook directory as the working dir, as when opened in Jupyter; the notebooks find the repo themselves.
    NotebookClient(book, kernel_name="python3", timeout=180,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    images = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    figure_cells = [c for c in book.cells if c.cell_type == "code" and FIGURE_CALL.search(c.source)]
    assert figure_cells and len(images) == len(figure_cells), f"{path.name}: a figure cell drew nothing"
