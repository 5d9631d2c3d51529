"""The package's architecture: an import graph without cycles (module-level and function-level imports
alike), one registry of families, and small modules (file and function size limits).

The graph is built from the source with ``ast``: every ``import dflash_jax.x`` and
``from dflash_jax... import y`` anywhere in a module (inside functions too: a lazy import that
closes a cycle is still a cycle) is an edge; ``from package import y`` is an edge to the
submodule ``package.y`` when there is one, else to ``package`` (a name of its ``__init__``); a
relative import resolves against the module's package. The enclosing packages that Python
initialises first are not edges: they are complete before the module starts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

PACKAGE = "dflash_jax"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _longest_module(name: str, modules: dict) -> str | None:
    """``name``, or the longest enclosing package of it that is a module of the package."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The package modules ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_longest_module(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else _longest_module(target, modules))
    found.discard(name)
    return {m for m in found if m is not None and m.split(".")[0] == PACKAGE}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the whole package."""
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (or a self-loop), each as one
    cycle through it ``[a, b, ..., a]``, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(_cycle_in(graph, comp) for comp in components)


def _cycle_in(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One cycle through the first module of a strongly connected component (breadth-first)."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp  # unreachable for a strongly connected component


def test_the_graph_sees_function_level_and_submodule_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from dflash_jax.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    (pkg / "c.py").write_text("import dflash_jax.sub.b\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.sub.b"}
    assert graph[f"{PACKAGE}.sub.b"] == {f"{PACKAGE}.a"}
    assert graph[f"{PACKAGE}.c"] == {f"{PACKAGE}.sub.b"}
    assert find_cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub.b", f"{PACKAGE}.a"]]


def test_no_import_cycle_inside_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles inside dflash_jax:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_registry_finds_each_family_by_architecture_and_type():
    import pytest

    from dflash_jax.drafter import model as kinds
    from dflash_jax.families import registry
    from dflash_jax.errors import DFlashError
    from dflash_jax.testing import tiny_target_config

    for fam in registry.TARGET_FAMILIES:
        for arch in fam.hf_architectures:
            assert registry.family_for_hf({"architectures": [arch]}) is fam
        for model_type in fam.hf_model_types:
            assert registry.family_for_hf({"model_type": model_type}) is fam
        assert all(callable(getattr(fam.model, f)) for f in ("embed", "forward_hidden", "lm_head", "init_cache"))
    assert registry.module_for(tiny_target_config("qwen3")) is registry.family_of(tiny_target_config("llama")).model
    with pytest.raises(DFlashError, match="architectures"):  # a drafter is not a target, whatever its model_type
        registry.family_for_hf({"architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna"}, "d/config.json")
    with pytest.raises(DFlashError, match="no registered family"):
        registry.module_for(object())
    for kind in kinds.DRAFTER_KINDS:
        assert kinds.drafter_kind(kind.architecture) is kind
    with pytest.raises(DFlashError, match="field hidden_size"):  # the DFlash2 kind's parser, reached by name
        kinds.drafter_config_from_hf({"architectures": ["DFlash2DraftModel"]})


MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 80


def test_modules_and_functions_stay_small():
    """Small modules with one job: no file of the package over 450 lines, no function over 80."""
    too_long = []
    for name, f in _modules().items():
        src = f.read_text()
        if src.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{name}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {n} lines")
    assert not too_long, "over the size limits: " + "; ".join(too_long)


# One speculative generation, traced afresh, as a reader follows it: the files of the package it
# enters (Python's profiler, call events). Run in a process of its own with no compile cache, so
# every step is traced.
_FILES_ENTERED = r"""
import os, sys
import dflash_jax as dj
from dflash_jax.testing import tiny_drafter, tiny_target
cfg, params = tiny_target()
dcfg, dparams = tiny_drafter(cfg, layer_ids=(0, 2), block_size=4)
target, drafter = dj.Target(cfg=cfg, params=params), dj.Drafter(cfg=dcfg, params=dparams)
pkg = os.path.dirname(dj.__file__) + os.sep
files = set()
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(pkg):
        files.add(os.path.relpath(frame.f_code.co_filename, pkg))
sys.setprofile(profile)
dj.generate(target, [[1, 2, 3, 4, 5]], max_new_tokens=8, drafter=drafter, n_max=3)
sys.setprofile(None)
print("\n".join(sorted(files)))
"""
# 20, plus nn/quant.py: the one matmul entry point every model calls (issue 47), plus nn/module.py:
# the steps read the models' nnx.State as their parameter trees (issue 51)
MAX_FILES_ENTERED = 22


def test_one_generation_enters_few_files():
    """A reader follows one speculative ``dj.generate`` (tiny pair, n_max 3, traced afresh) through at
    most :data:`MAX_FILES_ENTERED` of the package's files."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(DFLASH_JAX_NO_COMPILE_CACHE="1", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _FILES_ENTERED], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    files = out.stdout.split()
    assert "driver.py" in files and "decode/step.py" in files  # the profile saw the generation
    assert len(files) <= MAX_FILES_ENTERED, f"{len(files)} files entered: {files}"


def test_package_root_and_family_folders():
    """At most 12 modules at the package root (besides ``__init__``/``__main__``); each target family
    in one folder of ``families/`` with its config, model and loaders."""
    root = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(root) <= 12, root
    from dflash_jax.families import registry

    for fam in registry.TARGET_FAMILIES:
        folder = ROOT / "families" / fam.name
        assert {"config.py", "model.py", "safetensors.py", "gguf.py"} <= {p.name for p in folder.glob("*.py")}, fam.name
