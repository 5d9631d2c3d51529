"""The pure parts of the benchmark tools: ``bench_spec``'s interval resamples the ratio it reports;
``bench_policy`` parses its variants, and the argument types name what is wrong; ``bench_attention``'s
tables keep their columns; ``bench_recall`` builds its trees best-first and counts a tree's acceptance as
the deepest node on the target's path."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import bench_attention  # noqa: E402
import bench_policy  # noqa: E402
import bench_recall  # noqa: E402
import bench_spec  # noqa: E402
import benchlib  # noqa: E402

sys.path.pop(0)


def _runs(pairs):
    return dict(per_batch=[tuple(p) for p in pairs])


def test_interval_resamples_the_ratio_of_sums():
    # One long batch where a is slow, nine short ones where a is fast: the mean of per-batch
    # rates says a is faster, the ratio of sums (the reported figure) says it is slower.
    a = _runs([(100, 100.0)] + [(10, 0.5)] * 9)
    b = _runs([(100, 50.0)] + [(10, 1.0)] * 9)
    point = (190 / 104.5) / (190 / 59.0)
    lo, hi = bench_spec.ratio_interval(a, b, draws=4000)
    assert lo <= point <= hi
    # the same draws by hand: resample batch indices, then sums of tokens over sums of seconds
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 10, (4000, 10))
    pa, pb = np.array(a["per_batch"]), np.array(b["per_batch"])
    r = np.sort((pa[idx, 0].sum(1) / pa[idx, 1].sum(1)) / (pb[idx, 0].sum(1) / pb[idx, 1].sum(1)))
    assert (lo, hi) == pytest.approx((r[100], r[3900]))


def test_interval_of_identical_runs_is_one():
    a = _runs([(32, 1.5), (30, 2.0), (28, 1.0)])
    assert bench_spec.ratio_interval(a, a) == pytest.approx((1.0, 1.0))


def test_policy_variants_parse_constants_and_the_raw_calibration():
    got = bench_policy.parse_variants("8:0.05,16:0.15:raw")
    assert got == {"8 / 0.05": dict(max_backoff=8, pay_margin=0.05, raw=False),
                   "16 / 0.15 / raw": dict(max_backoff=16, pay_margin=0.15, raw=True)}


@pytest.mark.parametrize("text, says", [("8", "MAX_BACKOFF:PAY_MARGIN[:raw]"), ("8:0.05:fitted", "MAX_BACKOFF:PAY_MARGIN[:raw]"),
                                        ("8:0.05:raw:1", "MAX_BACKOFF:PAY_MARGIN[:raw]"), ("0:0.05", "max_backoff"),
                                        ("8:nan", "pay_margin"), ("8:0.05,8:0.05", "given twice")])
def test_policy_variants_name_what_is_wrong(text, says):
    with pytest.raises(SystemExit, match="--variants") as e:
        bench_policy.parse_variants(text)
    assert says in str(e.value)


def test_argument_types_accept_and_name_what_is_wrong():
    assert benchlib.int_list("1,8") == [1, 8]
    assert benchlib.at_least(0)("0") == 0
    for text in ("1,,2", "0", "1,1", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct integers >= 1"):
            benchlib.int_list(text)
    for text in ("0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="integer >= 1"):
            benchlib.at_least(1)(text)


@pytest.mark.parametrize("with_decode", [False, True])
def test_attention_tables_keep_their_columns(with_decode):
    blocks = [64, 128, 256]
    kern = [dict(length=20, width=1, capacity=1024, ms={64: 1.0, 128: 1.5, 256: 2.0}, agree=True)]
    dec = [dict(set="chat", kind="plain", rates={64: 30.0, 128: 29.0, 256: 28.0}, same=True)] if with_decode else []
    args = argparse.Namespace(layers=30, batch=1, repeats=3, decode_batch=1 if with_decode else 0, max_new_tokens=8, runs=1)
    text = bench_attention.section(kern, dec, blocks, args, [])
    assert ("Whole greedy generations" in text) == with_decode
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            tables.append(rows)
            rows = []
    assert len(tables) == (2 if with_decode else 1)
    # header, rule and rows of a table have as many columns: the fixed ones, one per block, one per ratio
    assert {line.count("|") for line in tables[0]} == {3 + 2 * len(blocks) - 1 + 1 + 1}
    if with_decode:
        assert {line.count("|") for line in tables[1]} == {2 + 2 * len(blocks) - 1 + 1 + 1}
    assert "**0.50**" in text  # 64 / 256


def test_recall_trees_grow_best_first_and_accept_the_deepest_node_on_the_target_path():
    # two slots, top-3 each: slot 1 [0.5, 0.3, 0.2], slot 2 [0.6, 0.3, 0.1] (sorted, as the tool keeps them)
    logp = np.log([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    # paths by probability: (0,) .5, (0, 0) .30, (1,) .3, (1, 0) .18, (2,) .2, (0, 1) .15, (2, 0) .12, ...
    assert bench_recall.best_first_tree(logp, 1) == {(0,)}
    assert bench_recall.best_first_tree(logp, 3) == {(0,), (0, 0), (1,)}
    assert bench_recall.best_first_tree(logp, 6) == {(0,), (0, 0), (1,), (1, 0), (2,), (0, 1)}
    assert len(bench_recall.best_first_tree(logp, 100)) == 3 + 9  # every node once, then it stops
    tree = {(0,), (0, 0), (1,)}
    assert [bench_recall.accepted(tree, r) for r in ([0, 0], [1, 0], [0, 2], [2, 0], [1, 3])] == [2, 1, 1, 0, 1]
    # static: the most frequent prefixes of the target's rank paths, a miss (rank = topk) is no node
    ranks = np.array([[0, 0], [0, 1], [0, 0], [1, 3], [3, 0]])
    assert bench_recall.static_tree(ranks, 3, topk=3) == {(0,), (0, 0), (1,)}
    assert bench_recall.ceiling(ranks, 1) == pytest.approx(1 + (2 + 1 + 2 + 0 + 0) / 5)
