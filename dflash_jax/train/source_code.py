"""Documented functions read from real source (``dflash-jax make-data --answers source`` and
``--sources``): every ``.py`` file of the standard library or of an installed top-level package,
read as text and parsed with ``ast``, never imported; tests, demos, IDLE, ``lib2to3`` and the
modules held out for evaluation (:data:`EVAL_MODULES`) are left out.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

# Held out of training (``os.path`` is ``posixpath`` here, so it is not in
# :data:`dflash_jax.train.prompt_lists.TRAIN_MODULES`): their functions make the code half of the
# evaluation prompts (:func:`dflash_jax.train.prompt_lists.held_out_prompts`).
EVAL_MODULES = ["posixpath"]

SKIP_PARTS = {"test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "__pycache__",
              "ensurepip", "pydoc_data"}


def source_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` (the standard library's or a package's folder), sorted,
    without tests, demos and the held-out modules."""
    held = {m.replace(".", "/") + ".py" for m in EVAL_MODULES}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_PARTS & set(rel.parts[:-1]) or rel.name.startswith("test_") or rel.as_posix() in held:
            continue
        out.append(p)
    return out


def source_root(name: str) -> tuple[Path, Path, str]:
    """``(root, files_root, tag)`` of one ``--sources`` entry: ``stdlib`` is the standard library's
    folder; any other name is an installed top-level package, whose parent folder is the root (so
    module names start with the package) and whose own folder holds the files; ``tag`` is the
    ``source`` prefix (``stdlib-src`` or ``pkg-src``).

    Raises DFlashError naming the entry when it is no installed package with a source folder."""
    from dflash_jax.errors import DFlashError

    if name == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return root, root, "stdlib-src"
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locs:
        raise DFlashError(f"--sources {name}", "no installed package folder", "stdlib or an installed top-level package")
    pkg = Path(locs[0])
    return pkg.parent, pkg, "pkg-src"


def source_version(name: str) -> str:
    """The recorded version of one ``--sources`` entry: Python's for ``stdlib``, else the version
    of the distribution that installs the package (``unknown`` when none is recorded)."""
    if name == "stdlib":
        return sys.version.split()[0]
    dists = importlib.metadata.packages_distributions().get(name, [])
    return importlib.metadata.version(dists[0]) if dists else "unknown"


def functions(path: Path, root: Path, tag: str = "stdlib-src") -> list[dict]:
    """``{"source", "stub", "code"}`` of each documented function or method of one file (module
    level and one class level), in file order; files that do not parse are skipped. ``source`` is
    ``"<tag>:<module>.<qualname>"`` with the module named relative to ``root``."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    mod = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
    nodes = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            nodes += [(f"{node.name}.{n.name}", n) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out = []
    for qual, fn in nodes:
        doc = ast.get_docstring(fn, clean=False)
        if not doc or len(doc.strip()) < 20 or fn.decorator_list:
            continue
        body0 = fn.body[0]  # the docstring expression
        code = textwrap.dedent("\n".join(lines[fn.lineno - 1 : fn.end_lineno]))
        stub = textwrap.dedent("\n".join(lines[fn.lineno - 1 : body0.end_lineno]))
        if len(fn.body) < 2 or '"""' in stub.split("\n", 1)[0]:
            continue  # a docstring-only function, or a one-line def
        out.append({"source": f"{tag}:{mod}.{qual}", "stub": stub + "\n", "code": code})
    return out


def source_functions(sources: str, seed: int) -> tuple[dict, list[dict]]:
    """``(roots, items)`` for a ``--sources`` value (comma-separated ``stdlib`` and installed
    top-level packages): ``roots`` maps each name to :func:`source_root`'s triple, ``items`` are
    the :func:`functions` of all their files, shuffled with ``random.Random(seed)``.

    Raises DFlashError naming ``--sources`` when it names nothing or a name twice, or a name
    that is no installed package."""
    from dflash_jax.errors import DFlashError

    names = [n.strip() for n in sources.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise DFlashError("--sources", repr(sources), "distinct comma-separated names (stdlib or installed packages)")
    roots = {n: source_root(n) for n in names}
    items = [f for n, (root, files, tag) in roots.items() for p in source_files(files) for f in functions(p, root, tag)]
    random.Random(seed).shuffle(items)
    return roots, items


def source_meta(roots: dict) -> dict:
    """What a dataset records of its sources: ``{name: {"path", "version"}}`` for
    :func:`source_functions`' ``roots``."""
    return {n: {"path": str(r[1]), "version": source_version(n)} for n, r in roots.items()}
