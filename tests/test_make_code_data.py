"""The code-completion recipe (``dflash-jax make-data --answers source``; :mod:`dflash_jax.train.source_code`
reads the functions): real standard-library functions asked in the HumanEval chat format and answered with
their own source, after an optional base dataset."""

from __future__ import annotations

import json
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from dflash_jax.cli import make_data as cli
from dflash_jax.train import source_code as m


def main(argv: list[str]) -> int:
    """``dflash-jax make-data --answers source`` with ``argv`` (DFlashError propagates)."""
    return cli.main(["--answers", "source", *argv])


def test_functions_are_documented_bodies_with_their_stub(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(textwrap.dedent('''\
        def documented(a, b=2):
            """Add two numbers and return the sum of them."""
            return a + b

        def undocumented(a):
            return a

        def only_doc():
            """A docstring and nothing else, so there is no body to complete."""

        @decorator
        def decorated(x):
            """Decorated functions are left out of the recipe."""
            return x

        class Box:
            def get(self,
                    key):
                """Return the value stored under the key, or None."""
                return self.d.get(key)
        '''))
    got = m.functions(tmp_path / "pkg" / "mod.py", tmp_path)
    assert [f["source"] for f in got] == ["stdlib-src:pkg.mod.documented", "stdlib-src:pkg.mod.Box.get"]
    assert got[0]["stub"] == 'def documented(a, b=2):\n    """Add two numbers and return the sum of them."""\n'
    assert got[0]["code"].endswith("return a + b")
    assert got[1]["stub"].startswith("def get(self,\n        key):") and got[1]["code"].endswith("return self.d.get(key)")
    (tmp_path / "bad.py").write_text("def broken(:\n")
    assert m.functions(tmp_path / "bad.py", tmp_path) == []


def test_source_files_leave_out_tests_and_held_out_modules():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = m.source_files(root)
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and len(rel) > 300
    assert "posixpath.py" not in rel and "json/decoder.py" in rel
    assert not any(part in m.SKIP_PARTS for r in rel for part in r.split("/")[:-1])


def test_sources_name_installed_packages(tmp_path, monkeypatch):
    from dflash_jax.errors import DFlashError

    pkg = tmp_path / "fakepkg_dfl"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    body = 'def f(x):\n    """Return twice the given number, as an integer."""\n    return 2 * x\n'
    (pkg / "mod.py").write_text(body)
    (pkg / "tests" / "helpers.py").write_text(body)  # tests are left out
    monkeypatch.syspath_prepend(str(tmp_path))
    root, files, tag = m.source_root("fakepkg_dfl")
    assert (root, files, tag) == (tmp_path, pkg, "pkg-src")
    got = [f["source"] for p in m.source_files(files) for f in m.functions(p, root, tag)]
    assert got == ["pkg-src:fakepkg_dfl.mod.f"]
    assert m.source_version("fakepkg_dfl") == "unknown" and m.source_version("stdlib") == sys.version.split()[0]
    assert m.source_root("stdlib")[2] == "stdlib-src"
    for bad in ("no_such_package_dfl", "textwrap", "not-a-name"):  # missing, a one-file module, not an identifier
        with pytest.raises(DFlashError, match=f"--sources {bad}"):
            m.source_root(bad)


@pytest.mark.slow
def test_dataset_follows_the_base_and_answers_with_the_source(tmp_path):
    from dflash_jax.errors import DFlashError
    from dflash_jax.train.data import TokenDataset

    base = TokenDataset.from_sequences([[1, 2, 3, 4], [5, 6, 7]], [[0, 0, 1, 1], [0, 1, 1]], {"recipe": "test"})
    base.save(tmp_path / "base")
    (tmp_path / "base" / "prompts.jsonl").write_text('{"source": "a"}\n{"source": "b"}\n')
    out = tmp_path / "code"
    assert main(["--out", str(out), "--base", str(tmp_path / "base"), "--num-sequences", "12", "--max-len", "200"]) == 0
    ds = TokenDataset.load(out)
    prompts = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(ds) == len(prompts) == 14 and [p["source"] for p in prompts[:2]] == ["a", "b"]
    for i in range(2):
        assert [a.tolist() for a in ds.sequence(i)] == [a.tolist() for a in base.sequence(i)]
    from dflash_jax.loading import load_target

    tok = load_target().tokenizer
    end = tok.token_to_id("<|im_end|>")
    for i in range(2, 14):
        toks, mask = ds.sequence(i)
        assert len(toks) <= 200 and toks[-1] == end and prompts[i]["source"].startswith("stdlib-src:")
        n = int((mask == 0).sum())
        assert mask[:n].sum() == 0 and mask[n:].all()  # the answer alone is supervised
        prompt, answer = tok.decode(toks[:n].tolist()), tok.decode(toks[n:-1].tolist())
        assert "Complete the following Python function" in prompt and answer.startswith("```python\ndef ")
        stub = prompt.split("```python\n", 1)[1].split("```", 1)[0]
        assert answer[len("```python\n"):].startswith(stub.rstrip("\n"))  # the answer completes the stub
    again = tmp_path / "again"
    assert main(["--out", str(again), "--base", str(tmp_path / "base"), "--num-sequences", "12", "--max-len", "200"]) == 0
    assert TokenDataset.load(again).fingerprint() == ds.fingerprint()  # deterministic
    grown = tmp_path / "grown"  # a base that already asks some functions: they are not asked again
    assert main(["--out", str(grown), "--base", str(out), "--num-sequences", "12", "--max-len", "200"]) == 0
    new = [json.loads(x)["source"] for x in (grown / "prompts.jsonl").read_text().splitlines()[14:]]
    assert len(new) == 12 and not set(new) & {p["source"] for p in prompts}
    with pytest.raises(DFlashError, match="--sources"):
        main(["--out", str(tmp_path / "x"), "--sources", "stdlib,stdlib"])
    (tmp_path / "base" / "prompts.jsonl").write_text('{"source": "a"}\n')
    with pytest.raises(DFlashError, match="prompts.jsonl"):
        main(["--out", str(tmp_path / "x"), "--base", str(tmp_path / "base"), "--num-sequences", "2"])
