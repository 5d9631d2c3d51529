"""Code-completion data for a DFlash drafter from real source: no generation, target labels.

Self-distillation (``tools/make_train_data.py``) makes about 110 answer tokens/s on a 2-core
CPU, and its prompts come from a few templates. This recipe instead asks the target, in the
HumanEval chat format, to complete real functions of the Python standard library's source and
writes the function's own source as the answer; the drafter is then trained with
``dflash-jax train --labels target``, which labels every position with the target's greedy next
token after the real prefix (computed in the same forward as the features), so the drafter still
learns what the target would write, while the context is varied real code. Building it takes
seconds; the target's only cost is the feature pass (about 390 tokens/s here, with the labels).

Recipe (deterministic; recorded in ``<out>/meta.json``):

* every ``.py`` file of each source of ``--sources`` (default ``stdlib``: the running Python's
  standard library, ``sysconfig`` ``stdlib`` path; other entries name installed top-level
  packages, located with ``importlib.util.find_spec`` and recorded with their distribution's
  version), sorted by path, except tests, demos, IDLE, ``lib2to3`` and the modules held out for
  evaluation (``posixpath``, see ``make_train_data.EVAL_MODULES``); read as text, parsed with
  ``ast``, never imported;
* every function or method with a docstring and a body (undecorated, module or class level):
  prompt = the ``complete`` template of ``make_train_data.CODE_TEMPLATES`` over a stub made of its
  ``def`` line(s) and docstring (as HumanEval asks), answer = the function's source (dedented)
  in a ``python`` code block, ended by the target's end-of-turn token, as the target formats its
  own answers; sequences over ``--max-len`` tokens (the training length: longer ones would be
  truncated, their cached features wasted) are skipped and each prompt is kept once;
* shuffled with ``random.Random(seed)``; the first ``--num-sequences`` kept (default: all);
* with ``--base DATASET`` the base dataset's sequences come first (for instance the
  self-distilled data), so one feature cache serves both and the base's cached rows are reused.

HumanEval is never read. Example::

    python tools/make_code_data.py --out data/code --base data/smollm2
    python tools/make_code_data.py --out data/code2 --base data/code --sources networkx,sympy
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import os
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from make_train_data import COMPLETE, EVAL_MODULES, Base  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output dataset folder")
    ap.add_argument("--base", default=None, help="dataset whose sequences come first (e.g. tools/make_train_data.py's)")
    ap.add_argument("--target", default=None, help="target .gguf or HF folder (its tokenizer; default: embedded SmolLM2)")
    ap.add_argument("--num-sequences", type=int, default=0, help="code sequences to keep (default 0: every function that fits)")
    ap.add_argument("--max-len", type=int, default=288, help="longest sequence (prompt + answer) in tokens (default 288)")
    ap.add_argument("--sources", default="stdlib",
                    help="comma-separated: stdlib and/or installed top-level packages to read functions from (default stdlib)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from dflash_jax.loading import load_target
    from dflash_jax.errors import DFlashError
    from dflash_jax.formats.files import write_text

    target = load_target(args.target)
    tok = target.tokenizer
    end = tok.token_to_id("<|im_end|>")
    if end is None or end not in target.eos_ids:
        raise DFlashError(f"{target.source}: tokenizer", "no <|im_end|> end-of-turn token among the stop ids", "a ChatML target")
    roots, items = source_functions(args.sources, args.seed)
    base = Base(args.base)
    seen = set(base.asked)  # a prompt the base already asks is not asked again
    seqs, masks, kept = [], [], []
    for it in items:
        if args.num_sequences and len(kept) >= args.num_sequences:
            break
        prompt = tok.encode_chat([{"role": "user", "content": COMPLETE.format(stub=it["stub"])}])
        if len(prompt) >= args.max_len or tuple(prompt) in seen:
            continue
        answer = tok.encode(f"```python\n{it['code']}\n```", add_bos=False) + [end]
        if len(prompt) + len(answer) > args.max_len:
            continue
        seen.add(tuple(prompt))
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
        kept.append({"source": it["source"], "kind": "complete-source"})
    if len(kept) < args.num_sequences:
        print(f"note: only {len(kept)} functions fit --max-len {args.max_len}", file=sys.stderr)

    meta = {
        "recipe": "tools/make_code_data.py",
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + list(argv if argv is not None else sys.argv[1:])),
        "target": str(target.source), "python": sys.version.split()[0], "seed": args.seed,
        "sources": source_meta(roots),
        "max_len": args.max_len, "code_sequences": len(kept),
        "code_tokens": int(sum(len(s) for s in seqs)),
        "labels": "train with --labels target: answers are real source, not the target's output",
        "chat_template": "target tokenizer's, default system prompt, one user turn",
        "heldout": "modules " + ", ".join(EVAL_MODULES) + "; HumanEval never used",
    }
    out = Path(args.out)
    ds = base.save_with(out, seqs, masks, kept, meta)
    if args.base and (Path(args.base) / "eval_prompts.json").is_file():
        write_text(out / "eval_prompts.json", (Path(args.base) / "eval_prompts.json").read_text(encoding="utf-8"))
    print(f"dataset: {len(ds)} sequences ({len(kept)} code), {len(ds.tokens)} tokens, {int(ds.loss_mask.sum())} supervised -> {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
