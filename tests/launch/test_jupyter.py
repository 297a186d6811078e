"""tpcore.spawn from a real Jupyter kernel: a function defined in a notebook
cell runs on 3 ranks, its prints show in the cell's output with the rank
prefix, and a rank's exception is raised in the cell."""
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    """
import numpy as np, tpcore
def work(comm, scale):
    x = np.full(4, float(comm.rank + 1))
    comm.all_reduce(x)
    print(f"hello from rank {comm.rank}")
    return float(x[0]) * scale
print("results", tpcore.spawn(work, 3, args=(10,), deadline=60))
""",
    """
def bad(comm):
    if comm.rank == 2:
        raise ValueError("raised in a notebook")
    comm.barrier()
try:
    tpcore.spawn(bad, 3, deadline=60)
except ValueError as e:
    print("caught", "rank 2" in str(e), "raised in a notebook" in str(e))
""",
]


def test_spawn_in_a_notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3")
    try:
        client.execute()
    except nbclient.exceptions.DeadKernelError as e:  # pragma: no cover
        pytest.fail(f"kernel died: {e}")
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") or str(out.get("data", "")))
    text = "".join(texts)
    for r in range(3):
        assert f"[rank{r}] hello from rank {r}" in text, text
    assert "results [60.0, 60.0, 60.0]" in text, text
    assert "caught True True" in text, text
