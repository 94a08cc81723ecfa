"""The notebooks of ``notebooks/``: executed headless, and checked for committed outputs.

Every ``notebooks/*.ipynb`` not in ``NOT_EXECUTED`` runs top to bottom with nbclient in a fresh
IPython kernel of *this* interpreter (the virtualenv that has jax_mla and the test extra), with
``notebooks/`` as its working directory and a timeout per cell; an error in any cell fails the
test with the cell's traceback. The kernel inherits this process's environment (CI's
``XLA_FLAGS``; the DCP notebook sets its own before importing jax).

Committed notebooks carry no outputs and no execution counts, so stale outputs cannot land;
the exceptions, ``KEEP_OUTPUTS``, are committed *with* outputs (04: its plots of
``benchmarks/results/``), saved from one clean run, and a fresh run must print exactly what the
committed one printed (results changed without a refresh fail here).

    python tests/test_notebooks.py clean     # strip outputs from every notebook but KEEP_OUTPUTS
    python tests/test_notebooks.py refresh   # re-execute the KEEP_OUTPUTS notebooks in place
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
ALL = sorted(NOTEBOOKS.glob("*.ipynb"))

# Notebooks CI does not execute (none: 04 only reads JSON and plots, in seconds, so it runs too).
NOT_EXECUTED: frozenset[str] = frozenset()
# Notebooks committed with their outputs; every other one must be committed clean.
KEEP_OUTPUTS = frozenset({"04_performance.ipynb"})

CELL_TIMEOUT_S = 180
KERNEL = "jax-mla-this-python"
# Appended to each executed notebook (and dropped after): which Python and which jax_mla ran it.
PROBE = ("import os\nimport sys\n\nimport jax_mla\n\n"
         "print(sys.executable)\nprint(os.path.realpath(jax_mla.__file__))")


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _stdout(nb) -> list[str]:
    """What each code cell printed (stdout), one string per cell."""
    return ["".join(o.get("text", "") for o in c.outputs
                    if o.output_type == "stream" and o.name == "stdout") for c in _code_cells(nb)]


def _images(nb) -> list[int]:
    return [sum("image/png" in o.get("data", {}) for o in c.outputs) for c in _code_cells(nb)]


def _errors(nb) -> list[str]:
    return [f"cell {i}: {o.ename}: {o.evalue}" for i, c in enumerate(_code_cells(nb))
            for o in c.outputs if o.output_type == "error"]


def execute(path: Path, kernel_dir: str) -> nbformat.NotebookNode:
    """Run ``path`` in a kernel of ``sys.executable``; return the executed notebook (the probe
    cell removed). Raises ``nbclient.exceptions.CellExecutionError`` on a failing cell."""
    spec = Path(kernel_dir, KERNEL)
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})", "language": "python"}))
    km = AsyncKernelManager(kernel_name=KERNEL,
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_dir]))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE, id="test-notebooks-probe"))
    NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    probe = nb.cells.pop()
    printed = "".join(o.get("text", "") for o in probe.outputs).splitlines()
    assert printed == [sys.executable, str(REPO / "jax_mla" / "__init__.py")], (
        f"{path.name} ran in {printed}, not in this interpreter with this tree's jax_mla "
        f"({sys.executable}, {REPO / 'jax_mla'})")
    return nb


def _clean(nb) -> None:
    for c in _code_cells(nb):
        c.outputs = []
        c.execution_count = None
        c.metadata.pop("execution", None)


def test_notebook_lists():
    names = {p.name for p in ALL}
    assert {"01_quickstart.ipynb", "02_model_layer.ipynb", "03_dcp.ipynb",
            "04_performance.ipynb", "05_rocm_host.ipynb"} <= names
    assert NOT_EXECUTED <= names and KEEP_OUTPUTS <= names, "a listed notebook is missing"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_committed_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    cells = _code_cells(nb)
    if path.name in KEEP_OUTPUTS:
        counts = [c.execution_count for c in cells]
        assert counts == list(range(1, len(cells) + 1)), (
            f"{path.name} must be saved from one clean run, top to bottom (execution counts "
            f"{counts}): python tests/test_notebooks.py refresh")
        assert not _errors(nb), _errors(nb)
        assert sum(_images(nb)) > 0, f"{path.name} is committed without its plots"
    else:
        stale = [i for i, c in enumerate(cells) if c.outputs or c.execution_count is not None]
        assert not stale, (f"{path.name}: code cells {stale} carry outputs or execution counts; "
                           "commit notebooks clean: python tests/test_notebooks.py clean")


@pytest.mark.parametrize("path", [p for p in ALL if p.name not in NOT_EXECUTED],
                         ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    ran = execute(path, str(tmp_path / "kernels"))
    assert not _errors(ran), _errors(ran)
    if path.name in KEEP_OUTPUTS:
        committed = nbformat.read(path, as_version=4)
        assert _stdout(ran) == _stdout(committed), (
            f"{path.name}'s committed outputs are stale (what it prints from the results has "
            "changed): python tests/test_notebooks.py refresh")
        assert _images(ran) == _images(committed), (_images(ran), _images(committed))


def main(argv) -> int:
    if argv not in (["clean"], ["refresh"]):
        print("\n".join(__doc__.strip().splitlines()[-2:]), file=sys.stderr)
        return 2
    for path in ALL:
        if argv == ["clean"] and path.name not in KEEP_OUTPUTS:
            nb = nbformat.read(path, as_version=4)
            before = copy.deepcopy(nb)
            _clean(nb)
            if nb != before:
                nbformat.write(nb, path)
                print(f"cleaned {path.relative_to(REPO)}")
        elif argv == ["refresh"] and path.name in KEEP_OUTPUTS:
            with tempfile.TemporaryDirectory() as d:
                nb = execute(path, d)
            nbformat.write(nb, path)
            print(f"refreshed {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
