"""Every notebook in notebooks/ runs top to bottom (CI executes them with ``tools/run_notebook.py``,
the headless command), and is committed executed: its figures and numbers are visible where it is
rendered without running it (GitHub)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import real_model_env

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def run_notebook(*argv) -> subprocess.CompletedProcess:
    """``python tools/run_notebook.py ARGV`` from the repository root, in :func:`conftest.real_model_env`
    (the walkthrough runs the default model)."""
    return subprocess.run([sys.executable, "tools/run_notebook.py", *map(str, argv)], cwd=REPO, capture_output=True, text=True,
                          timeout=3600, env=real_model_env())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_executed_with_inline_figures(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    source = "\n".join("".join(c["source"]) for c in code)
    assert all(c.get("execution_count") for c in code), "every code cell executed, in order"
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "a figure stored inline"
    assert "%matplotlib inline" in source and 'matplotlib.use("Agg")' not in source
    assert "JAX_PLATFORMS" not in source, "the notebook runs on the device JAX finds (GPU when there is one)"
    assert path.stat().st_size < 200_000, "outputs kept small"


_NUMBER = r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf"
# The forms in which the notebook prints tau (tokens committed per verify step): `print(stats)` -> 'tau': 2.4359,
# the per-prompt line -> tau 2.25, and the numpy array -> tau per prompt: [2.25 1.34 ...] (may wrap over lines).
_TAU_PATTERNS = (rf"'tau': ({_NUMBER})", rf"\btau ({_NUMBER})", r"tau per prompt: \[([^\]]*)\]")
_PER_POSITION = r"acceptance per draft position: \[([^\]]*)\]"


def printed_acceptance(nb):
    """What a notebook's text outputs say about acceptance: [(where, tau)] in the order printed, and the number of
    entries of each printed per-draft-position acceptance list. Takes nbformat nodes or the plain json alike."""
    taus, per_position = [], []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        text = ""
        for o in cell.get("outputs", []):
            stream = o.get("output_type") == "stream"
            text += "".join(o.get("text", "") if stream else o.get("data", {}).get("text/plain", "")) + ("" if stream else "\n")
        found = []
        for pattern in _TAU_PATTERNS:
            for m in re.finditer(pattern, text):
                values = re.findall(_NUMBER, m.group(1))
                if len(values) == 1:  # where: the printed line
                    where = [text[text.rfind("\n", 0, m.start()) + 1:].split("\n", 1)[0][:60]]
                else:  # where: the list, and which entry of it
                    where = [f"{' '.join(m.group(0).split())} entry {k + 1}" for k in range(len(values))]
                found += [(m.start(), k, f"cell {i}, {w!r}", float(v)) for k, (w, v) in enumerate(zip(where, values))]
        taus += [(where, value) for _, _, where, value in sorted(found)]
        per_position += [len(re.findall(_NUMBER, m.group(1))) for m in re.finditer(_PER_POSITION, text)]
    return taus, per_position


# The notebook decodes greedily at a fixed depth, so its tau is deterministic up to float32 sums that reduce in
# another order on another CPU (vector width, XLA's tiling, thread count) or a GPU: a logit near-tie can then pick
# another token and move one prompt's tau by a step's worth. 0.15 tokens/step absorbs that (and the 2-decimal
# rounding of the printout) while a real change in drafting or verification moves tau by more.
TAU_ATOL = 0.15
_REEXECUTE = "re-execute the notebook and commit its outputs: python tools/run_notebook.py notebooks/{name}"


def compare_acceptance(stored, fresh, name, atol=TAU_ATOL):
    """Fails, naming the value, when a fresh run's printed acceptance differs from what the notebook has stored."""
    (stored_taus, stored_pos), (fresh_taus, fresh_pos) = printed_acceptance(stored), printed_acceptance(fresh)
    fix = _REEXECUTE.format(name=name)
    assert stored_taus, f"{name}: no tau found in the stored outputs (did the printouts change?); {fix}"
    assert len(fresh_taus) == len(stored_taus), (
        f"{name}: the stored outputs print {len(stored_taus)} tau values, a fresh run {len(fresh_taus)}: "
        f"{[v for _, v in stored_taus]} vs {[v for _, v in fresh_taus]}; {fix}")
    for (label, old), (_, new) in zip(stored_taus, fresh_taus):
        assert abs(new - old) <= atol, (
            f"{name}: {label} is {old} in the stored outputs but {new} in a fresh run (|diff| > {atol}); {fix}")
    assert fresh_pos == stored_pos, (
        f"{name}: the per-position acceptance lists have {stored_pos} draft positions in the stored outputs, "
        f"{fresh_pos} in a fresh run; {fix}")


def test_the_acceptance_comparison_finds_each_printed_tau_and_names_what_moved():
    def notebook(*texts):
        return {"cells": [{"cell_type": "code", "outputs": [{"output_type": "stream", "text": t}]} for t in texts]}

    printed = ("{'tau': 2.4359, 'verify_steps': 39}\n", "tau 2.25  dflash   10.0 tok/s\ntau 1.34  dflash    6.1 tok/s\n",
               "acceptance per draft position: [0.52  0.272 0.142] | tau per prompt: [2.25\n 1.34]\n")
    stored = notebook(*printed)
    taus, per_position = printed_acceptance(stored)
    assert [v for _, v in taus] == [2.4359, 2.25, 1.34, 2.25, 1.34] and per_position == [3]
    compare_acceptance(stored, notebook(*printed[:2], printed[2].replace("[2.25", "[2.3")), "nb")  # within 0.15
    with pytest.raises(AssertionError, match="tau 1.34 .* is 1.34 in the stored outputs but 1.6"):
        compare_acceptance(stored, notebook(printed[0], printed[1].replace("tau 1.34", "tau 1.6"), printed[2]), "nb")
    with pytest.raises(AssertionError, match=r"\[3\] draft positions in the stored outputs, \[1\]"):
        compare_acceptance(stored, notebook(*printed[:2], printed[2].replace("0.52  0.272 0.142", "0.083")), "nb")
    with pytest.raises(AssertionError, match="5 tau values, a fresh run 4"):
        compare_acceptance(stored, notebook(printed[0], printed[1].split("\n", 1)[1], printed[2]), "nb")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    """Runs top to bottom (``tools/run_notebook.py --out``: the committed file is left alone), and today's code
    prints the acceptance (tau) its stored outputs show."""
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    committed = path.read_bytes()
    stored = nbformat.read(path, as_version=4)  # the committed outputs
    out = tmp_path / path.name
    r = run_notebook(path, "--out", out)
    assert r.returncode == 0, r.stderr[-6000:]
    assert path.read_bytes() == committed
    compare_acceptance(stored, nbformat.read(out, as_version=4), path.name)


def _tiny_notebook(path: Path, *cells: str) -> Path:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, path)
    return path


def test_run_notebook_writes_the_executed_copy_and_stops_at_a_failing_cell(tmp_path):
    """The headless command: every cell executed in order, run in the notebook's own folder, the
    copy written to --out (or in place); a failing cell exits with 1 and writes nothing; a path that
    is no notebook is a usage error (2)."""
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    src = _tiny_notebook(tmp_path / "tiny.ipynb", "import os\nprint(os.path.basename(os.getcwd()))", "6 * 7")
    r = run_notebook(src, "--out", tmp_path / "out" / "tiny.ipynb")
    assert r.returncode == 0, r.stderr[-3000:]
    nb = nbformat.read(tmp_path / "out" / "tiny.ipynb", as_version=4)
    assert [c.execution_count for c in nb.cells] == [1, 2]
    assert nb.cells[0].outputs[0]["text"].strip() == tmp_path.name and nb.cells[1].outputs[0]["data"]["text/plain"] == "42"
    assert all(not c.get("execution_count") for c in nbformat.read(src, as_version=4).cells)  # --out leaves the source alone
    assert run_notebook(src).returncode == 0 and nbformat.read(src, as_version=4).cells[1].execution_count == 2  # in place
    bad = _tiny_notebook(tmp_path / "bad.ipynb", "raise ValueError('boom')")
    r = run_notebook(bad, "--out", tmp_path / "bad_out.ipynb")
    assert r.returncode == 1 and "boom" in r.stderr and not (tmp_path / "bad_out.ipynb").exists()
    r = run_notebook(tmp_path / "missing.ipynb")
    assert r.returncode == 2 and "missing.ipynb: not a notebook file" in r.stderr
