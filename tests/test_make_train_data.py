"""The self-distillation data recipe (``dflash-jax make-data``, :mod:`dflash_jax.train.make_data`): a deterministic prompt list
whose older lists are prefixes of newer ones, and resumable generation by continuous batching that
never reuses a shard answering other prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.cli import make_data as cli
from dflash_jax.train import make_data, prompt_lists, source_code

REPO = Path(__file__).resolve().parents[1]


def _list(seed: int, hashseed: str) -> list[dict]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run([sys.executable, "-m", "dflash_jax", "make-data", "--out", "unused", "--num-prompts", "100000", "--seed", str(seed), "--list-prompts"],
                         capture_output=True, text=True, env=env, check=True, cwd=REPO).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_prompt_list_is_the_same_in_every_process():
    """Two interpreters (different hash seeds, different memory layouts) list the same prompts;
    default values whose repr holds a memory address once made a few prompts differ."""
    a, b = _list(0, "1"), _list(0, "2")
    assert a == b and len(a) > 3000
    assert not any("at 0x" in p["text"] for p in a)
    seen: dict = {}
    for i, p in enumerate(a):
        seen.setdefault(p["source"], []).append(i)
    first_round2 = min(v[1] for k, v in seen.items() if k.startswith("stdlib:") and len(v) > 1)
    round1 = a[:first_round2]
    assert len({p["source"] for p in round1 if p["source"].startswith("stdlib:")}) == sum(p["source"].startswith("stdlib:") for p in round1)
    assert all(p["source"].startswith("stdlib:") for p in a[first_round2:])  # appended: round 1 stays a prefix
    for src, where in seen.items():
        if src.startswith("stdlib:"):
            assert len(where) == 2, src
            k1, k2 = a[where[0]]["kind"], a[where[1]]["kind"]
            assert k1 != k2 and (k2 == "complete") == (k1 != "complete")


@pytest.mark.slow
def test_generation_resumes_and_ignores_foreign_shards(tmp_path):
    """Answers come back from earlier runs' shards (also when more prompts are asked), rows are
    refilled as they finish (continuous batching) without changing any answer, and a shard made
    with other settings is never used."""
    from dflash_jax.train.data import TokenDataset

    out = tmp_path / "data"
    common = ["--out", str(out), "--max-new", "3", "--prompt-cap", "128"]
    assert cli.main(common + ["--num-prompts", "2", "--batch-size", "2"]) == 0
    shard0 = out / "shards" / "answers_00000.npz"
    first = os.stat(shard0).st_ino
    # one row refilled at a time: five prompts through two rows, the first two read back
    assert cli.main(common + ["--num-prompts", "5", "--batch-size", "2", "--refill", "1"]) == 0
    assert os.stat(shard0).st_ino == first
    assert sorted(np.load(out / "shards" / "answers_00001.npz")["index"].tolist()) == [2, 3]
    assert np.load(out / "shards" / "answers_00002.npz")["index"].tolist() == [4]
    ds = TokenDataset.load(out)
    assert len(ds) == 5
    again = tmp_path / "again"  # all five in one batch of five rows: the same greedy answers
    assert cli.main(["--out", str(again), "--max-new", "3", "--prompt-cap", "128", "--num-prompts", "5", "--batch-size", "5"]) == 0
    assert TokenDataset.load(again).fingerprint() == ds.fingerprint()
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    for i, p in enumerate(prompts):
        toks, mask = ds.sequence(i)
        assert int((mask == 0).sum()) == p["prompt_tokens"] and 1 <= int(mask.sum()) <= 3
    # other settings (--max-new 2): every shard is foreign, all five prompts are answered again
    assert cli.main(["--out", str(out), "--max-new", "2", "--prompt-cap", "128", "--num-prompts", "5", "--batch-size", "2"]) == 0
    assert sorted(sum((np.load(f)["index"].tolist() for f in sorted((out / "shards").glob("answers_*.npz"))[3:]), [])) == [0, 1, 2, 3, 4]
    assert all(int(TokenDataset.load(out).sequence(i)[1].sum()) <= 2 for i in range(5))


def test_a_shard_is_read_only_for_its_own_prompts_and_settings(tmp_path):
    settings = json.dumps({"max_new": 3})
    ids = [[1, 2, 3], [4, 5], [6]]
    seqs = [[4, 5, 7], [1, 2, 3, 9, 9]]

    def write(index, **extra):
        np.savez(path, index=np.array(index), tokens=np.concatenate(seqs), lengths=np.array([3, 5]), prompt_lens=np.array([2, 3]), **extra)

    path = tmp_path / "answers_00000.npz"
    write([1, 0], settings=np.frombuffer(settings.encode(), np.uint8))
    got = make_data._read_shard(path, ids, settings)
    assert sorted(got) == [0, 1] and got[0].tolist() == seqs[1] and got[1].tolist() == seqs[0]
    assert list(make_data._read_shard(path, ids[:1], settings)) == [0]  # entries past the prompts asked now are left out
    assert make_data._read_shard(tmp_path / "missing.npz", ids, settings) is None
    assert make_data._read_shard(path, [[1, 2, 3], [4, 6]], settings) is None  # index 1 is another prompt now
    assert make_data._read_shard(path, ids, json.dumps({"max_new": 4})) is None  # made with other settings
    write([1, 0])
    assert make_data._read_shard(path, ids, settings) is None  # settings not recorded
    path.write_bytes(b"not a zip")
    assert make_data._read_shard(path, ids, settings) is None


def _fake_package(tmp_path, monkeypatch, name="fakepkg_sd"):
    """A package of three documented functions whose prompts differ in length."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("".join(
        f'def f{i}(x):\n    """Return the number multiplied by {i}{", twice over" * i}, as an integer."""\n    return {i} * x\n\n'
        for i in range(3)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_source_prompts_ask_every_function_as_humaneval_does(tmp_path, monkeypatch):
    from dflash_jax.errors import DFlashError

    name = _fake_package(tmp_path, monkeypatch)
    roots, listed = prompt_lists.source_prompts(name, 0)
    assert list(roots) == [name] and sorted(p["source"] for p in listed) == [f"pkg-src:{name}.mod.f{i}" for i in range(3)]
    assert all(p["kind"] == "complete" and p["text"].startswith("Complete the following Python function") for p in listed)
    assert all(p["text"] == prompt_lists.COMPLETE.format(stub=p["text"].split("```python\n", 1)[1][:-3]) for p in listed)
    assert prompt_lists.source_prompts(name, 0)[1] == listed != prompt_lists.source_prompts(name, 5)[1]  # a seeded shuffle
    assert source_code.source_meta(roots) == {name: {"path": str(tmp_path / name), "version": "unknown"}}
    for bad in ("", ",", f"{name},{name}"):
        with pytest.raises(DFlashError, match="--sources"):
            prompt_lists.source_prompts(bad, 0)


def test_base_comes_first_and_its_prompt_lines_are_checked(tmp_path):
    from dflash_jax.errors import DFlashError
    from dflash_jax.train.data import TokenDataset

    assert make_data.Base(None).seqs == [] and make_data.Base(None).meta is None
    src = tmp_path / "base"
    base_ds = TokenDataset.from_sequences([[1, 2, 3, 4], [5, 6, 7]], [[0, 0, 1, 1], [0, 1, 1]], {"recipe": "test"})
    base_ds.save(src)
    base = make_data.Base(str(src))  # no prompts.jsonl: one empty record per sequence
    assert base.asked == {(1, 2), (5,)} and base.lines == ["{}", "{}"] and base.meta["fingerprint"] == base_ds.fingerprint()
    ds = base.save_with(tmp_path / "out", [[8, 9]], [[0, 1]], [{"source": "new"}], {"recipe": "x"})
    assert [ds.sequence(i)[0].tolist() for i in range(3)] == [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    assert TokenDataset.load(tmp_path / "out").meta["base"]["path"] == str(src)
    assert (tmp_path / "out" / "prompts.jsonl").read_text().splitlines() == ["{}", "{}", '{"source": "new"}']
    (src / "prompts.jsonl").write_text('{"source": "a"}\n')
    with pytest.raises(DFlashError, match="prompts.jsonl"):
        make_data.Base(str(src))


@pytest.mark.slow
def test_sources_answers_follow_the_base_and_no_prompt_is_asked_twice(tmp_path, monkeypatch):
    """``--sources`` asks the target to complete a package's documented functions; ``--base``
    puts a dataset's sequences first and skips the prompts it already asks, so growing a dataset
    never repeats a prompt; a rerun reuses every shard."""
    from dflash_jax.decode import loop as decode
    from dflash_jax.loading import load_target
    from dflash_jax.train.data import TokenDataset

    name = _fake_package(tmp_path, monkeypatch)
    _, listed = prompt_lists.source_prompts(name, 0)
    base = TokenDataset.from_sequences([[1, 2, 3, 4]], [[0, 0, 1, 1]], {"recipe": "test"})
    base.save(tmp_path / "base")
    (tmp_path / "base" / "prompts.jsonl").write_text('{"source": "a"}\n')
    common = ["--sources", name, "--max-new", "3", "--batch-size", "2"]
    one = tmp_path / "one"
    assert cli.main(["--out", str(one), "--base", str(tmp_path / "base"), "--num-prompts", "2"] + common) == 0
    ds = TokenDataset.load(one)
    prompts = [json.loads(x) for x in (one / "prompts.jsonl").read_text().splitlines()]
    assert len(ds) == len(prompts) == 3 and prompts[0] == {"source": "a"}
    assert [a.tolist() for a in ds.sequence(0)] == [a.tolist() for a in base.sequence(0)]
    assert [p["source"] for p in prompts[1:]] == [p["source"] for p in listed[:2]]
    tok = load_target().tokenizer
    for i in (1, 2):  # row i answers prompt line i
        toks, mask = ds.sequence(i)
        assert toks[mask == 0].tolist() == tok.encode_chat([{"role": "user", "content": prompts[i]["text"]}])
        assert 1 <= int(mask.sum()) <= 3
    meta = json.loads((one / "meta.json").read_text())
    assert meta["base"]["fingerprint"] == base.fingerprint() and meta["sources"] == {"pkg-src": 2}
    assert list(meta["sources_read"]) == [name] and meta["code_fraction"] is None

    def no_generation(*a, **k):
        raise AssertionError("a shard was generated again")

    monkeypatch.setattr(decode, "generate_until", no_generation)  # a rerun reads every shard back
    monkeypatch.setattr(decode, "prefill", no_generation)
    assert cli.main(["--out", str(one), "--base", str(tmp_path / "base"), "--num-prompts", "2"] + common) == 0
    assert TokenDataset.load(one).fingerprint() == ds.fingerprint()
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(tmp_path))
    two = tmp_path / "two"  # grown from the first: only the function it does not ask yet is left
    assert cli.main(["--out", str(two), "--base", str(one), "--num-prompts", "2"] + common) == 0
    sources = [json.loads(x).get("source") for x in (two / "prompts.jsonl").read_text().splitlines()]
    assert sources[:3] == [p["source"] for p in prompts] and sources[3:] == [listed[2]["source"]]


@pytest.mark.parametrize("argv, says", [
    (["--answers", "source", "--max-new", "3"], "error: --max-new: given with --answers source (expected --answers target with --max-new, or no --max-new)"),
    (["--max-len", "200"], "error: --max-len: given with --answers target (expected --answers source with --max-len, or no --max-len)"),
    (["--batch-size", "0"], "error: --batch-size: got 0 (expected an integer >= 1)"),
    (["--batch-size", "4", "--refill", "5"], "error: --refill: got 5 (expected an integer in [1, --batch-size = 4])"),
    (["--code-fraction", "1.5"], "error: --code-fraction: got 1.5 (expected a number in [0, 1])"),
    (["--answers", "other"], "error: --answers: got 'other' (expected one of: target, source)"),
    ([], "error: --out: missing (expected a value)"),
])
def test_make_data_refuses_options_of_the_other_recipe_and_bad_values(capsys, argv, says):
    """``dflash-jax make-data``: one line naming the option, exit code 2, before anything loads."""
    from dflash_jax.cli.main import main

    assert main(["make-data", *(["--out", "unused"] if argv else []), *argv]) == 2
    err = capsys.readouterr().err
    assert err.strip() == says or err.startswith(says), err
