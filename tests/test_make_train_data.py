"""The self-distillation data recipe (``tools/make_train_data.py``): a deterministic prompt list
whose older lists are prefixes of newer ones, and resumable generation that never reuses a shard
answering other prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "make_train_data.py"


def _list(seed: int, hashseed: str) -> list[dict]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run([sys.executable, str(TOOL), "--out", "unused", "--num-prompts", "100000", "--seed", str(seed), "--list-prompts"],
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
def test_generation_resumes_and_regenerates_foreign_shards(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_train_data as m
    finally:
        sys.path.pop(0)
    from dflash_jax.train.data import TokenDataset

    out = tmp_path / "data"
    common = ["--out", str(out), "--max-new", "3", "--prompt-cap", "128"]
    assert m.main(common + ["--num-prompts", "2", "--batch-size", "2"]) == 0
    shard0 = out / "shards" / "batch_00000.npz"
    first = os.stat(shard0).st_ino
    assert m.main(common + ["--num-prompts", "3", "--batch-size", "2"]) == 0  # batch 0 kept, batch 1 new
    assert os.stat(shard0).st_ino == first
    ds = TokenDataset.load(out)
    assert len(ds) == 3
    # a third prompt in batch 0: the two-prompt shard answers other prompts and is generated again
    assert m.main(common + ["--num-prompts", "3", "--batch-size", "3"]) == 0
    ds3 = TokenDataset.load(out)
    assert len(ds3) == 3 and len(np.load(shard0)["lengths"]) == 3 and os.stat(shard0).st_ino != first
    for i in range(3):  # same prompts, same greedy answers, whatever the batch
        np.testing.assert_array_equal(ds3.sequence(i)[0], ds.sequence(i)[0])
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    for i, p in enumerate(prompts):
        toks, mask = ds3.sequence(i)
        assert int((mask == 0).sum()) == p["prompt_tokens"] and 1 <= int(mask.sum()) <= 3


def test_a_shard_is_read_only_for_its_own_prompts_and_settings(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_train_data as m
    finally:
        sys.path.pop(0)
    settings = json.dumps({"max_new": 3})
    chunk = [[1, 2, 3], [4, 5]]
    seqs = [[1, 2, 3, 9, 9], [4, 5, 7]]
    path = tmp_path / "batch_00000.npz"
    np.savez(path, tokens=np.concatenate(seqs), lengths=np.array([5, 3]), prompt_lens=np.array([3, 2]),
             settings=np.frombuffer(settings.encode(), np.uint8))
    shard = m._read_shard(path, chunk, settings)
    np.testing.assert_array_equal(shard["tokens"], np.concatenate(seqs))
    assert shard["lengths"].tolist() == [5, 3] and shard["prompt_lens"].tolist() == [3, 2]
    assert m._read_shard(tmp_path / "missing.npz", chunk, settings) is None
    assert m._read_shard(path, [[1, 2, 3], [4, 6]], settings) is None  # same count, another prompt
    assert m._read_shard(path, chunk[:1], settings) is None
    assert m._read_shard(path, chunk, json.dumps({"max_new": 4})) is None  # made with other settings
    np.savez(path, tokens=np.concatenate(seqs), lengths=np.array([5, 3]), prompt_lens=np.array([3, 2]))
    assert m._read_shard(path, chunk, settings) is None  # settings not recorded
    path.write_bytes(b"not a zip")
    assert m._read_shard(path, chunk, settings) is None
