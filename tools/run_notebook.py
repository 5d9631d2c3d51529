"""Executes a notebook headless, top to bottom, and writes the executed copy.

The walkthrough (``notebooks/dflash_walkthrough.ipynb``) is committed executed, so its figures and
numbers show where it is rendered without running it; after a change that moves what it prints,
rerun it with this and commit the result::

    python tools/run_notebook.py                                   # the walkthrough, in place
    python tools/run_notebook.py notebooks/dflash_walkthrough.ipynb --out /tmp/executed.ipynb

Cells run with nbclient (``pip install -e .[test]`` or ``.[notebook]`` brings it and ipykernel)
in a ``python3`` kernel whose working folder is the notebook's own; a cell that raises stops the
run (exit 1, the error named; nothing is written). Usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "notebooks" / "dflash_walkthrough.ipynb"


def execute(path: Path, out: Path, timeout: int = 900, kernel: str = "python3") -> None:
    """Runs every cell of the notebook at ``path`` (working folder: its own) and writes the
    executed notebook to ``out`` (``path`` itself for in place). Raises nbclient's
    ``CellExecutionError`` when a cell fails (nothing is written then)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name=kernel, record_timing=False,
                            resources={"metadata": {"path": str(path.resolve().parent)}}).execute()
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebook", nargs="?", type=Path, default=DEFAULT, help="the .ipynb to run (default: the walkthrough)")
    p.add_argument("--out", type=Path, default=None, help="where to write the executed copy (default: over the notebook itself)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one cell may run (default 900)")
    args = p.parse_args(argv)
    if not args.notebook.is_file() or args.notebook.suffix != ".ipynb":
        p.error(f"{args.notebook}: not a notebook file (expected an existing .ipynb)")
    if args.timeout < 1:
        p.error(f"--timeout: got {args.timeout} (expected an integer >= 1)")
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError as e:
        p.error(f"{e.name}: not installed (expected nbclient and nbformat: pip install -e .[test])")
    from nbclient.exceptions import CellExecutionError

    out = args.out or args.notebook
    try:
        execute(args.notebook, out, args.timeout)
    except CellExecutionError as e:
        print(f"error: {args.notebook}: a cell failed, nothing written:\n{e}", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
