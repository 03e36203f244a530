"""The quickstart notebook runs end to end, so it cannot rot.

It is executed with nbclient in a temporary copy of the folders it uses, so that
its ``runs/`` and ``report_html/`` never land in the repository.
"""

from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path

import nbclient
import nbformat
import pytest
from PIL import Image

from actviz.pictures.rendering import grid_layout, tile_size

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
#: Per cell; the whole notebook takes well under a minute on two cores.
CELL_TIMEOUT = 300


def _code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _images(cell: nbformat.NotebookNode) -> list[Image.Image]:
    return [
        Image.open(io.BytesIO(base64.b64decode(output["data"]["image/png"])))
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[nbformat.NotebookNode, Path]:
    """The notebook run in ``<tmp>/notebooks`` beside a copy of ``<tmp>/tests/data``."""
    root = tmp_path_factory.mktemp("quickstart")
    (root / "notebooks").mkdir()
    shutil.copytree(REPO / "tests" / "data", root / "tests" / "data")
    workdir = root / "notebooks"
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    return notebook, workdir


def test_committed_notebook_has_no_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for cell in _code_cells(notebook):
        assert cell.outputs == [] and cell.execution_count is None, "strip the outputs before committing"


def test_notebook_trains_with_the_watcher(executed: tuple[nbformat.NotebookNode, Path]) -> None:
    _, workdir = executed
    assert list((workdir / "runs" / "quickstart").glob("events.out.tfevents.*"))


def test_notebook_shows_a_feature_map_grid_inline(executed: tuple[nbformat.NotebookNode, Path]) -> None:
    notebook, _ = executed
    cell = next(cell for cell in _code_cells(notebook) if "feature_map_grid(" in cell.source)
    (picture,) = _images(cell)
    # 8 channels of 32 x 32 in a 3 x 3 grid, drawn by the notebook at double size.
    height, width = grid_layout(8, *tile_size(32, 32))
    assert picture.size == (2 * width, 2 * height)
    low, high = picture.convert("L").getextrema()
    assert low < high


def test_notebook_reports_one_image(executed: tuple[nbformat.NotebookNode, Path]) -> None:
    notebook, workdir = executed
    assert (workdir / "report_html" / "index.html").is_file()
    assert list((workdir / "runs" / "report").rglob("events.out.tfevents.*"))
    cell = next(cell for cell in _code_cells(notebook) if "actviz.report(" in cell.source)
    printed = "".join(output.get("text", "") for output in cell.outputs)
    assert "features.0" in printed and "dead channels" in printed
    grid_cell = next(cell for cell in _code_cells(notebook) if ".grid[" in cell.source)
    (picture,) = _images(grid_cell)
    assert picture.width > 0 and picture.height > 0
