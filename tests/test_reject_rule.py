"""The standard rejection rule (``Decoding(draft_mode="reject")``, :func:`dflash_jax.decode.step.reject_rule`):
its sampled output follows the target's distribution (chi-square against the enumerated joint, as
test_spec's sample-and-match tests), greedy output equals plain greedy decoding, it accepts more
sampled drafts than sample-and-match, and what a seed promises under it."""

import numpy as np
import pytest

from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.state import Decoding
from dflash_jax.errors import DFlashError
from dflash_jax.testing import tiny_drafter, tiny_target
from test_draft_vocab import with_vocab
from test_spec import PROMPTS, assert_follows_target, drafter_for, outputs, plain_greedy, run_spec

N = 6000


@pytest.fixture(scope="module")
def small():
    cfg, params = tiny_target("llama", seed=11, vocab_size=8, scale=0.5)
    return (cfg, params), tiny_drafter(cfg, seed=1, block_size=4, layer_ids=(0, 2), scale=0.5)


def _accepted(st) -> int:
    return int(np.asarray(st.speculative.accepted).sum())


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.7, top_p=0.9)], ids=["t1", "t0.7-p0.9"])
def test_rejection_rule_follows_target_and_accepts_more_than_sample_and_match(small, sampling):
    """Chi-square of (t1, t2, t3) of 6000 rows against the target's exact joint; with the same
    drafts' distributions the rejection rule accepts more drafts than matching the target's
    positional sample (sum min(p, q) is the most any rule accepts; the shared uniform's coupling of
    the two CDFs reaches less unless q is p or one-hot)."""
    target, d = small
    cfg, params = target
    prompt = [1, 5, 2]
    st = run_spec(target, d, [prompt] * N, 3, chunk=4, max_len=8, sampling=sampling, seed=123, mode="reject", n_max=3)
    assert (np.asarray(st.length) == 6).all()
    assert_follows_target(cfg, params, prompt, sampling, np.asarray(st.tokens[:, 3:6]))
    match = run_spec(target, d, [prompt] * N, 3, chunk=4, max_len=8, sampling=sampling, seed=123, mode="sample", n_max=3)
    # about 2 sd of the difference at these counts (a few hundred accepted drafts in 6000 rows)
    assert _accepted(st) > _accepted(match) + 60, (_accepted(st), _accepted(match))


def test_rejection_rule_with_a_draft_vocabulary_follows_target(small):
    """The drafter's q laid out over the target's ids (4 of 8 listed): still the target's distribution."""
    target, d = small
    cfg, params = target
    prompt, sampling = [1, 5, 2], SamplingConfig(1.0)
    dv = with_vocab(target, d, [0, 2, 3, 5])
    st = run_spec(target, dv, [prompt] * N, 3, chunk=4, max_len=8, sampling=sampling, seed=7, mode="reject", n_max=3)
    assert _accepted(st) > N // 20, "the drafter should get some tokens accepted"
    assert_follows_target(cfg, params, prompt, sampling, np.asarray(st.tokens[:, 3:6]))


def test_rejection_rule_greedy_equals_plain_and_a_seed_gives_the_same_sample():
    """Greedy rows answer as plain greedy decoding. A sampled row's output is a function of its
    seed, prompt, settings, drafter and n_max: the same alone or beside other rows; it is not plain
    decoding's sample of that seed (the residual draws differ from the target's positional ones)."""
    target = tiny_target("qwen3", seed=3)
    d = drafter_for(target[0], 4)
    assert outputs(run_spec(target, d, PROMPTS, 20, mode="reject", n_max=3)) == plain_greedy(target, PROMPTS, 20)
    hot = SamplingConfig(1.0)
    seeds = list(range(len(PROMPTS)))
    batch = outputs(run_spec(target, d, PROMPTS, 20, sampling=hot, seed=seeds, mode="reject", n_max=3))
    alone = [outputs(run_spec(target, d, [p], 20, sampling=hot, seed=[s], mode="reject", n_max=3))[0] for p, s in zip(PROMPTS, seeds)]
    assert batch == alone
    plain = outputs(run_spec(target, d, PROMPTS, 20, sampling=hot, seed=seeds, mode="sample", n_max=3))  # plain's own sample
    assert batch != plain


@pytest.mark.parametrize("kw,match", [(dict(n_max="auto"), "n_max='auto'"), (dict(n_max=3, tree=2), "tree"),
                                      (dict(n_max=3, selector_top_k=4), "selector")])
def test_rejection_rule_refuses_what_it_does_not_cover(small, kw, match):
    (cfg, _), _ = small
    top_k = kw.pop("selector_top_k", 0)
    dcfg = tiny_drafter(cfg, seed=1, block_size=4, layer_ids=(0, 2), architecture="DFlash2DraftModel", conv_kernel_size=2,
                        conv_group_size=16, selector_rank=8, selector_top_k=top_k)[0] if top_k else small[1][0]
    with pytest.raises(DFlashError, match=f"draft_mode|{match}"):
        Decoding(cfg, dcfg, "reject", **kw)
