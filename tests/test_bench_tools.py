"""The pure parts of the benchmark tools: ``bench_spec``'s interval resamples the ratio it reports;
``bench_policy`` parses its variants or names what is wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import bench_policy  # noqa: E402
import bench_spec  # noqa: E402

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
