"""DFlash speculative decoding: losslessness, acceptance bookkeeping, stops, batching, exact sampling.

Oracles: the target's own greedy decode (plain loop, itself checked against a no-cache
recomputation in test_decode.py), scripted drafters whose acceptance is known in advance, a fresh
prefill of the committed tokens (for the drafter context) and exact enumerated distributions.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decode import loop as decode
from dflash_jax.decode import step as speculative
from dflash_jax.decode.auto.costs import CostModel, depth_policy
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.auto.policy import Calibration, verify_widths
from dflash_jax.decode.state import LENGTH, STOP
from dflash_jax.testing import tiny_drafter, tiny_target, verify_scripted
from dflash_jax.families.registry import module_for

GREEDY = SamplingConfig()


def auto_policy(n):
    """``n_max="auto"``'s numbers for tests: confident predictions and cheap widths (the step
    verifies all ``n`` drafts) but a plain step cheaper still (the propose does not pay: the next
    step is a plain step)."""
    return depth_policy(Calibration((1.0,) * n, (2.0,) * n), CostModel(step_cost=(tuple(1.0 + 0.1 * w for w in verify_widths(n)),), plain_cost=(0.3,),
                                                                          widths=verify_widths(n)))
PROMPTS = [[5, 9, 17, 3, 22, 8, 1], [40, 2, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 30, 31]]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)


def drafter_for(cfg, block_size=4, seed=0, **kw):
    return tiny_drafter(cfg, seed=seed, block_size=block_size, layer_ids=(0, 2), **kw)


def plain_greedy(target, prompts, n_new, max_len=64, stop_ids=()):
    cfg, params = target
    st = decode.init_state(Decoding(cfg), prompts, max_len, n_new, stop_ids)
    st = decode.decode_loop(Params(params), decode.prefill(Params(params), st, Decoding(cfg), 4), Decoding(cfg))
    return outputs(st)


def outputs(st):
    toks, plen, length = jax.device_get((st.tokens, st.prompt_len, st.length))
    return [[int(t) for t in toks[b, plen[b] : length[b]]] for b in range(toks.shape[0])]


def run_spec(target, d, prompts, n_new, chunk=4, max_len=64, stop_ids=(), n_max=None, sampling=GREEDY, seed=0, mode="argmax"):
    cfg, params = target
    dcfg, dparams = d
    static, weights = Decoding(cfg, dcfg, mode, n_max), Params(params, dparams)
    if n_max == "auto":
        weights = weights._replace(depth=auto_policy(static.depth))
    st = decode.init_state(static, prompts, max_len, n_new, stop_ids, seed=seed, sampling=sampling)
    return decode.decode_loop(weights, decode.prefill(weights, st, static, chunk), static)


@pytest.mark.parametrize("block_size", [2, pytest.param(4, marks=pytest.mark.smoke), 6])  # smoke: DFlash greedy equals plain
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_lossless_random_drafter(target, block_size, batch):
    d = drafter_for(target[0], block_size)
    prompts = PROMPTS[:batch]
    assert outputs(run_spec(target, d, prompts, 20)) == plain_greedy(target, prompts, 20)


def scripted_run(target, d, prompt, n_new, corrupt_at=None, stop_ids=(), max_len=64):
    """Drives verify with drafts taken from the target's greedy continuation (optionally wrong at
    draft position ``corrupt_at``); returns the state and the acceptance of every step."""
    cfg, params = target
    dcfg, dparams = d
    ref = plain_greedy(target, [prompt], n_new + dcfg.block_size, max_len=max_len)[0]
    full = list(prompt) + ref
    st = decode.init_state(Decoding(cfg, dcfg), [prompt], max_len, n_new, stop_ids)
    st = decode.prefill(Params(params, dparams), st, Decoding(cfg, dcfg), 3)
    def verify(s, drafts):
        return speculative.verify_block(Params(params, dparams), s, Decoding(cfg, dcfg), jnp.asarray([drafts], jnp.int32))

    st, accepts = verify_scripted(st, full, dcfg.block_size - 1, verify, corrupt_at, cfg.vocab_size)
    return st, accepts, ref


@pytest.mark.parametrize("block_size", [3, 5])
def test_scripted_full_acceptance_commits_block_size_tokens(target, block_size):
    d = drafter_for(target[0], block_size)
    n_new = 1 + 4 * block_size  # prefill token + 4 full blocks
    st, accepts, ref = scripted_run(target, d, PROMPTS[0], n_new)
    assert outputs(st)[0] == ref[:n_new]
    assert accepts == [block_size - 1] * 4
    assert int(st.speculative.verify_steps[0]) == 4 and int(st.committed[0]) == 4 * block_size


@pytest.mark.parametrize("j", [0, 1, 3])
def test_scripted_rejection_exactly_at_j(target, j):
    d = drafter_for(target[0], 5)
    st, accepts, ref = scripted_run(target, d, PROMPTS[1], 16, corrupt_at=j)
    assert outputs(st)[0] == ref[:16]
    assert all(a == j for a in accepts[:-1])  # the last step may be cut by max_new_tokens
    per_pos = np.asarray(st.speculative.accepted_per_position[0])
    assert (per_pos[j:] == 0).all()
    assert (per_pos[:j] >= len(accepts) - 1).all()


@pytest.mark.parametrize("offset", [0, 3, 4])
def test_bug_stop_in_block(target, offset):
    """EOS at block offset 0, 3 and block_size - 1 (B31/B33/B34): output stops exactly there and
    statistics never count tokens after the stop."""
    d = drafter_for(target[0], 5)
    # after the prefill token, the first full-accept block commits ref[1:6]; offset k = ref[1 + k]
    candidates = PROMPTS + [[p + 1 for p in q] for q in PROMPTS]
    refs = plain_greedy(target, candidates, 30)
    prompt, ref = next((p, r) for p, r in zip(candidates, refs) if r[1 + offset] not in r[: 1 + offset])
    stop = ref[1 + offset]
    st, accepts, _ = scripted_run(target, d, prompt, 30, stop_ids=(stop,))
    out = outputs(st)[0]
    assert out == ref[: 2 + offset] and out[-1] == stop
    assert int(st.finish[0]) == STOP
    assert int(st.committed[0]) == 1 + offset == len(out) - 1
    assert int(st.speculative.accepted[0]) == min(offset + 1, 4)


@pytest.mark.parametrize("n_new", [1, 2, 3])
def test_max_new_tokens_smaller_than_block(target, n_new):
    d = drafter_for(target[0], 6)
    st, _, ref = scripted_run(target, d, PROMPTS[2], n_new)
    assert outputs(st)[0] == ref[:n_new]
    assert int(st.finish[0]) == LENGTH
    assert int(st.committed[0]) == n_new - 1


def test_batch_rows_equal_rows_alone(target):
    d = drafter_for(target[0], 4, seed=5)
    batch = outputs(run_spec(target, d, PROMPTS, 18, stop_ids=(7,)))
    alone = [outputs(run_spec(target, d, [p], 18, stop_ids=(7,)))[0] for p in PROMPTS]
    assert batch == alone == plain_greedy(target, PROMPTS, 18, stop_ids=(7,))


@pytest.mark.parametrize("chunk", [1, 3, 7, 13])
def test_bug_capture_offsets_chunk_size_invariance(target, chunk):
    """The drafter context, the first draft block and the generation do not depend on the prefill
    chunk size (B18: micro-batch capture kept only the last micro-batch)."""
    cfg, params = target
    dcfg, dparams = drafter_for(cfg, 4, seed=1)

    def after_prefill(c):
        st = decode.init_state(Decoding(cfg, dcfg), PROMPTS, 64, 12)
        return decode.prefill(Params(params, dparams), st, Decoding(cfg, dcfg), c)

    ref, got = after_prefill(13), after_prefill(chunk)
    for b, p in enumerate(PROMPTS):
        n = len(p)
        np.testing.assert_allclose(np.asarray(got.speculative.ctx_k[:, b, :n]), np.asarray(ref.speculative.ctx_k[:, b, :n]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got.speculative.ctx_v[:, b, :n]), np.asarray(ref.speculative.ctx_v[:, b, :n]), rtol=1e-5, atol=1e-5)
    d_ref, _ = speculative.propose_block(Params(params, dparams), ref, Decoding(cfg, dcfg))
    d_got, _ = speculative.propose_block(Params(params, dparams), got, Decoding(cfg, dcfg))
    assert np.array_equal(np.asarray(d_ref), np.asarray(d_got))
    out = outputs(decode.decode_loop(Params(params, dparams), got, Decoding(cfg, dcfg)))
    assert out == outputs(decode.decode_loop(Params(params, dparams), ref, Decoding(cfg, dcfg)))


def test_bug_rollback_context_holds_only_committed_rows(target):
    """After verifies with rejections, the context equals a fresh prefill of the committed tokens
    (rejected rows never enter; positions of context rows are their absolute positions)."""
    cfg, params = target
    dcfg, dparams = drafter_for(cfg, 5, seed=2)
    st, accepts, _ = scripted_run(target, (dcfg, dparams), PROMPTS[1], 14, corrupt_at=2, max_len=40)
    assert any(a < 4 for a in accepts)
    n = int(st.length[0]) - 1
    committed = [int(t) for t in np.asarray(st.tokens[0, :n])]
    fresh = decode.init_state(Decoding(cfg, dcfg), [committed], 40, 1)
    fresh = decode.prefill(Params(params, dparams), fresh, Decoding(cfg, dcfg), 5)
    np.testing.assert_allclose(np.asarray(st.speculative.ctx_k[:, 0, :n]), np.asarray(fresh.speculative.ctx_k[:, 0, :n]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.speculative.ctx_v[:, 0, :n]), np.asarray(fresh.speculative.ctx_v[:, 0, :n]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.cache.k[:, 0, :n]), np.asarray(fresh.cache.k[:, 0, :n]), rtol=1e-5, atol=1e-5)


def test_per_layer_drafter_gives_the_stacked_results(target):
    """Drafter parameters as per-layer buffers (``unstack_layers``, ``load_drafter``'s CPU
    layout, run as a Python loop) compute what the stacked ``lax.scan`` computes: context K/V,
    the hidden states of a draft pass, and the tokens and statistics of speculative decoding.
    One drafter whose layers differ (causal or not, a window or none) and with biases: a loop
    that handed a layer another layer's settings would fail; uniform layers add nothing."""
    from dflash_jax.nn.params import unstack_layers
    from dflash_jax.drafter import model as dm
    from dflash_jax.nn.params import PerLayer

    cfg, params = target
    dcfg, dp = drafter_for(cfg, 4, seed=3, attention_bias=True, layer_causal=(True, False), layer_window=(0, 3))
    per = unstack_layers(dp)
    assert isinstance(per["layers"], PerLayer) and len(per["layers"]) == dcfg.num_hidden_layers
    feats = jax.random.normal(jax.random.key(1), (1, 6, len(dcfg.target_layer_ids) * cfg.hidden_size))
    ctx_pos = jnp.arange(6, dtype=jnp.int32)[None]
    kv = [dm.context_kv(d, dcfg, feats, ctx_pos) for d in (dp, per)]
    block, pos = jnp.asarray([[3, dcfg.mask_token_id, dcfg.mask_token_id, dcfg.mask_token_id]]), ctx_pos[:, :4] + 5
    hidden = [dm.forward(d, dcfg, module_for(cfg), params, cfg, block, pos, k, v, jnp.asarray([5])) for d, (k, v) in zip((dp, per), kv)]
    for a, b in [*zip(kv[0], kv[1]), hidden]:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(hidden[0]), np.asarray(dm.forward(dp, dcfg, module_for(cfg), params, cfg, block, pos + 1, *kv[0], jnp.asarray([5]))))
    runs = [run_spec(target, (dcfg, d), PROMPTS, 20) for d in (dp, per)]
    assert outputs(runs[0]) == outputs(runs[1]) == plain_greedy(target, PROMPTS, 20)
    for name in ("verify_steps", "drafted", "accepted", "accepted_per_position"):
        np.testing.assert_array_equal(np.asarray(getattr(runs[0].speculative, name)), np.asarray(getattr(runs[1].speculative, name)), err_msg=name)


def test_bug_positions_block_uses_absolute_positions(target):
    """The block's RoPE positions continue from the anchor's absolute position: shifting the
    positions changes the drafts (so the test can fail), and the loop's drafts equal a direct
    drafter call at positions ``length - 1 + i``."""
    from dflash_jax.drafter import model as dm

    cfg, params = target
    dcfg, dparams = drafter_for(cfg, 4, seed=4)
    st = decode.init_state(Decoding(cfg, dcfg), [PROMPTS[2]], 64, 8)
    st = decode.prefill(Params(params, dparams), st, Decoding(cfg, dcfg), 4)
    drafts, _ = speculative.propose_block(Params(params, dparams), st, Decoding(cfg, dcfg))
    start = int(st.length[0]) - 1
    block = jnp.asarray([[int(st.tokens[0, start])] + [dcfg.mask_token_id] * 3])

    def direct(offset):
        pos = jnp.arange(start, start + 4, dtype=jnp.int32)[None] + offset
        h = dm.forward(dparams, dcfg, module_for(cfg), params, cfg, block, pos, st.speculative.ctx_k, st.speculative.ctx_v, jnp.asarray([start]))
        return dm.logits(dparams, dcfg, module_for(cfg), params, cfg, h[:, 1:])

    np.testing.assert_array_equal(np.asarray(drafts), np.asarray(jnp.argmax(direct(0), -1)))
    assert not np.allclose(np.asarray(direct(0)), np.asarray(direct(5)))


def test_bug_mask_id_block_is_anchor_then_mask_tokens(target):
    """Block slots 1.. hold the drafter's mask_token_id (B38/B40): the loop's drafts equal a
    direct drafter call on ``[anchor, mask, mask, mask]``, another id gives other logits, and a
    mask id outside the target's embedding is refused."""
    import dataclasses

    from dflash_jax.drafter import model as dm

    cfg, params = target
    dcfg, dparams = drafter_for(cfg, 4, seed=6)
    st = decode.init_state(Decoding(cfg, dcfg), [PROMPTS[0]], 64, 8)
    st = decode.prefill(Params(params, dparams), st, Decoding(cfg, dcfg), 4)
    drafts, _ = speculative.propose_block(Params(params, dparams), st, Decoding(cfg, dcfg))
    start = int(st.length[0]) - 1
    pos = jnp.arange(start, start + 4, dtype=jnp.int32)[None]

    def direct(mask_id):
        block = jnp.asarray([[int(st.tokens[0, start])] + [mask_id] * 3])
        h = dm.forward(dparams, dcfg, module_for(cfg), params, cfg, block, pos, st.speculative.ctx_k, st.speculative.ctx_v, jnp.asarray([start]))
        return dm.logits(dparams, dcfg, module_for(cfg), params, cfg, h[:, 1:])

    np.testing.assert_array_equal(np.asarray(drafts), np.asarray(jnp.argmax(direct(dcfg.mask_token_id), -1)))
    assert not np.allclose(np.asarray(direct(dcfg.mask_token_id)), np.asarray(direct(3)))
    with pytest.raises(DFlashError, match="mask_token_id"):
        decode.init_state(Decoding(cfg, dataclasses.replace(dcfg, mask_token_id=cfg.vocab_size)), [PROMPTS[0]], 64, 8)


def test_bug_layer_id_convention_capture_is_output_of_layer(target):
    """Captured id i is the residual after decoder layer i (HF hidden_states[i + 1]) (B10/B12)."""
    from dflash_jax.runtime.carry import init_capture
    from dflash_jax.families.dense import model as dense

    cfg, params = target
    toks = jnp.asarray([PROMPTS[0]])
    pos = jnp.arange(len(PROMPTS[0]), dtype=jnp.int32)[None]
    cap = init_capture((0, 1), 1, len(PROMPTS[0]), cfg.hidden_size, jnp.float32)
    _, _, cap = dense.MODEL.forward(params, cfg, toks, pos, dense.MODEL.init_cache(cfg, 1, 16), cap)
    # run the stack truncated to 1 and 2 layers: its pre-norm output is hidden_states[i + 1]
    for i in (0, 1):
        sub = jax.tree.map(lambda x: x[: i + 1], params["layers"])
        cfg_i = __import__("dataclasses").replace(cfg, num_hidden_layers=i + 1)
        cap_i = init_capture((i,), 1, len(PROMPTS[0]), cfg.hidden_size, jnp.float32)
        _, _, cap_i = dense.MODEL.forward(dict(params, layers=sub), cfg_i, toks, pos, dense.MODEL.init_cache(cfg_i, 1, 16), cap_i)
        h = cfg.hidden_size
        np.testing.assert_allclose(np.asarray(cap.hidden[..., i * h : (i + 1) * h]), np.asarray(cap_i.hidden), rtol=1e-6, atol=1e-6)


def test_bug_config_schema_refuses_what_it_cannot_run(target):
    from dflash_jax.drafter.model import drafter_config_from_hf

    base = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "num_target_layers": 3,
        "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 2], "block_size": 4},
    }
    assert drafter_config_from_hf(base).target_layer_ids == (0, 2)
    with pytest.raises(DFlashError, match="field dflash_config.conv_kernel_size"):  # a DFlash2 drafter without its fields
        drafter_config_from_hf(dict(base, architectures=["DFlash2DraftModel"]))
    for field in ("mask_token_id", "target_layer_ids", "block_size"):
        broken = dict(base, dflash_config={k: v for k, v in base["dflash_config"].items() if k != field})
        with pytest.raises(DFlashError, match=field):
            drafter_config_from_hf(broken, "d/config.json")
    from dflash_jax.drafter.config import check_drafter_fits

    bad = drafter_config_from_hf(dict(base, dflash_config=dict(base["dflash_config"], target_layer_ids=[0, 3])))
    with pytest.raises(DFlashError, match="target_layer_ids"):
        check_drafter_fits(bad, target[0])


def test_config_fields_set_twice_must_agree_and_layer_ids_be_distinct():
    from dflash_jax.drafter.model import drafter_config_from_hf

    base = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "num_target_layers": 3,
        "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 2], "block_size": 8},
    }
    # the same value in both places is fine (a tuple-vs-list difference is not a contradiction)
    same = dict(base, block_size=8, mask_token_id=127, target_layer_ids=[0, 2])
    assert drafter_config_from_hf(same).block_size == 8
    for field, other in (("block_size", 4), ("mask_token_id", 5), ("target_layer_ids", [0, 1])):
        with pytest.raises(DFlashError) as e:
            drafter_config_from_hf(dict(base, **{field: other}), "d/config.json")
        msg = str(e.value)
        assert msg.startswith(f"d/config.json: field {field}:") and f"dflash_config.{field}" in msg and "top level" in msg
        assert repr(other) in msg and "(expected " in msg
    for ids in ([1, 1, 2], [0, 2, 0]):
        with pytest.raises(DFlashError, match="more than once") as e:
            drafter_config_from_hf(dict(base, dflash_config=dict(base["dflash_config"], target_layer_ids=ids)), "d/config.json")
        assert "target_layer_ids" in str(e.value) and "distinct" in str(e.value)


def plain_sampled(target, prompts, n_new, sampling, seed):
    cfg, params = target
    static = Decoding(cfg)
    st = decode.init_state(static, prompts, 64, n_new, seed=seed, sampling=sampling)
    return outputs(decode.decode_loop(Params(params), decode.prefill(Params(params), st, static, 4), static))


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_a_seeded_row_samples_the_same_tokens_with_any_drafter_depth_or_batch(target, mode):
    """Sampling is indexed by position (:mod:`dflash_jax.decode.sampling`): a seeded row commits the
    target's own sampled tokens, the same as plain sampled decoding, with a drafter at any
    ``n_max`` or under auto, alone or beside other prompts (one seed per prompt)."""
    sampling, seeds, n_new = SamplingConfig(0.3), [11, 12, 13], 16
    want = plain_sampled(target, PROMPTS, n_new, sampling, seeds)
    assert want != plain_sampled(target, PROMPTS, n_new, sampling, [21, 22, 23]), "the seed decides the sample"
    assert [plain_sampled(target, [p], n_new, sampling, [k])[0] for p, k in zip(PROMPTS, seeds)] == want
    d = drafter_for(target[0], 4, seed=2)  # a random drafter that the target at 0.3 agrees with now and then
    accepted = 0
    for n_max in (1, 3, "auto"):
        st = run_spec(target, d, PROMPTS, n_new, n_max=n_max, sampling=sampling, seed=seeds, mode=mode)
        assert outputs(st) == want, n_max
        accepted += int(np.asarray(st.speculative.accepted).sum())
    assert outputs(run_spec(target, d, PROMPTS[1:2], n_new, n_max=3, sampling=sampling, seed=seeds[1:2], mode=mode))[0] == want[1]
    assert accepted > 0, "some drafts accepted: the match path is exercised, not only the bonus token"


def test_n_max_validation_and_depth(target):
    cfg, params = target
    dcfg, dparams = drafter_for(cfg, 6)
    with pytest.raises(DFlashError, match="--n-max"):
        decode.init_state(Decoding(cfg, dcfg, n_max=6), [PROMPTS[0]], 32, 4)
    st = run_spec(target, (dcfg, dparams), [PROMPTS[0]], 12, n_max=2)
    assert st.speculative.accepted_per_position.shape == (1, 2)
    assert outputs(st) == plain_greedy(target, [PROMPTS[0]], 12)



def test_step_arguments_that_do_not_go_together_are_named(target):
    """Every mismatch of params, state and Decoding is a DFlashError naming the argument, not an
    AttributeError from deep inside a trace (including the pre-0.2 argument orders)."""
    cfg, params = target
    dcfg, dparams = drafter_for(cfg, 4)
    spec, plain = Decoding(cfg, dcfg), Decoding(cfg)
    plain_state = decode.init_state(plain, [PROMPTS[0]], 32, 4)
    spec_state = decode.init_state(spec, [PROMPTS[0]], 32, 4)
    cases = [
        (lambda: decode.init_state(cfg, [PROMPTS[0]], 32, 4), "static"),  # the old order
        (lambda: decode.prefill(params, plain_state, plain, 4), "params"),  # a bare params dict
        (lambda: decode.prefill(Params(params), spec_state, spec, 4), "params.drafter"),
        (lambda: decode.prefill(Params(params, dparams), plain_state, spec, 4), "no drafter context"),
        (lambda: decode.prefill(Params(params), spec_state, plain, 4), "a drafter context under a Decoding without"),
        (lambda: decode.decode_step(Params(params, dparams), spec_state, Decoding(cfg, dcfg, n_max=2)), "n_max 3"),
        (lambda: Decoding(cfg, dcfg, n_max=2.0), "--n-max"),  # n_max is checked once, by Decoding
        (lambda: Decoding(cfg, n_max="2"), "without a drafter"),
        (lambda: Decoding(cfg, cfg), "DrafterConfig"),
        (lambda: Decoding(dcfg), "registered family|TargetConfig"),
    ]
    for call, match in cases:
        with pytest.raises(DFlashError, match=match):
            call()


def _chi2_threshold(df, z=3.29):  # Wilson-Hilferty, upper 0.9995 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


DFLASH2 = dict(architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


@pytest.mark.parametrize("mode,sampling,n_max,kind", [("argmax", SamplingConfig(1.0), None, {}), ("sample", SamplingConfig(1.0), None, {}),
                                                       ("sample", SamplingConfig(0.8, top_k=5), None, {}), ("sample", SamplingConfig(1.0), "auto", {}),
                                                       ("sample", SamplingConfig(1.0), None, DFLASH2), ("argmax", SamplingConfig(0.8, top_p=0.9), None, DFLASH2)])
def test_sampled_tokens_follow_target_distribution(mode, sampling, n_max, kind):
    """Chi-square of (t1, t2, t3) over many independent rows against the exact enumerated target
    distribution, on an 8-token vocabulary (two of three tokens come from a verify step). With
    ``n_max="auto"`` the first step verifies the width its policy chooses (holding both drafts that fit) and,
    as that propose does not pay, the rows that need a third token get it from a plain step. ``kind``: a
    DFlash2 drafter (its selector's drafts, sampled from its q over 4 candidates, or its greedy path)."""
    cfg, params = tiny_target("llama", seed=11, vocab_size=8, scale=0.5)
    d = tiny_drafter(cfg, seed=1, block_size=4, layer_ids=(0, 2), scale=0.5, **kind)
    prompt = [1, 5, 2]
    n = 6000
    st = run_spec((cfg, params), d, [prompt] * n, 3, chunk=4, max_len=8, sampling=sampling, seed=123, mode=mode, n_max=n_max)
    if n_max == "auto":
        # the budget leaves room for two drafts: the verify widths are 1 and 3, and 3 verifies both
        assert np.asarray(st.speculative.widths).tolist() == [0, 0, 0, 1] and int(st.steps) == 2
    assert (np.asarray(st.length) == 6).all()
    # the drafter must contribute: about 600 accepted drafts here (sd ~25), under auto about 300 (its second step
    # is plain, it drafts nothing; sd ~17)
    least = n // 20 if n_max is None else n // 40
    assert int(np.asarray(st.speculative.accepted).sum()) > least, "the drafter should get some tokens accepted"
    assert_follows_target(cfg, params, prompt, sampling, np.asarray(st.tokens[:, 3:6]))


def assert_follows_target(cfg, params, prompt, sampling, toks):
    """Chi-square test of sampled continuations ``toks [n, 3]`` of ``prompt`` against the target's
    exact joint distribution of its next three tokens (enumerated; vocabulary of 8). Returns the
    joint ``[8, 8, 8]``."""
    from dflash_jax.families.dense import model as dense
    from dflash_jax.decode.sampling import probabilities

    assert len(prompt) == 3 and cfg.vocab_size == 8 and np.shape(toks)[1] == 3, "written for 3 + 3 tokens over 8 ids"
    n = len(toks)
    seqs = np.array([[*prompt, a, b] for a in range(8) for b in range(8)], np.int32)
    logits, _, _ = dense.MODEL.forward(params, cfg, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(5), seqs.shape), dense.MODEL.init_cache(cfg, 64, 8))
    p = np.asarray(probabilities(logits, sampling))
    joint = p[0, 2][:, None, None] * p[::8, 3][:, :, None] * p[:, 4].reshape(8, 8, 8)  # p(t1) p(t2 | t1) p(t3 | t1 t2)
    counts = np.zeros((8, 8, 8))
    np.add.at(counts, tuple(np.asarray(toks).T), 1)
    exp, obs = joint.ravel() * n, counts.ravel()
    assert obs[exp == 0].sum() == 0, "a token outside the sampling support was emitted"
    big, small = exp >= 5, (exp < 5) & (exp > 0)
    chi2 = ((obs[big] - exp[big]) ** 2 / exp[big]).sum()
    if exp[small].sum() > 0:
        chi2 += (obs[small].sum() - exp[small].sum()) ** 2 / exp[small].sum()
    df = int(big.sum()) + int(exp[small].sum() > 0) - 1
    assert chi2 < _chi2_threshold(df), (chi2, df)
    return joint


def test_no_compilation_during_generation_after_warmup(target):
    """One compilation per (config, shapes): a second generation of the same shapes compiles nothing."""
    from dflash_jax.runtime.compiled import count_compilations

    d = drafter_for(target[0], 4, seed=8)
    run_spec(target, d, PROMPTS, 10, chunk=4)
    with count_compilations() as compiled:
        run_spec(target, d, [[p + 1 for p in q] for q in PROMPTS], 10, chunk=4, seed=1)
    assert compiled() == 0


@pytest.mark.slow
def test_replaced_rows_of_a_speculative_state_answer_as_alone(target):
    """``decode.replace_rows`` also swaps a speculative state's drafter context and statistics:
    a row given a new prompt after a few steps answers it exactly as plain greedy decoding, and
    its statistics count only the new answer."""
    cfg, params = target
    dcfg, dparams = drafter_for(cfg)
    step = jax.jit(decode.speculative_step_fn, static_argnames=("static",))
    st = decode.prefill(Params(params, dparams), decode.init_state(Decoding(cfg, dcfg), PROMPTS[:2], 64, 20), Decoding(cfg, dcfg), 4)
    for _ in range(3):
        st = step(Params(params, dparams), st, Decoding(cfg, dcfg))
    fresh = decode.prefill(Params(params, dparams), decode.init_state(Decoding(cfg, dcfg), [PROMPTS[2]], 64, 20), Decoding(cfg, dcfg), 4)
    st = decode.decode_loop(Params(params, dparams), decode.replace_rows(st, fresh, jnp.asarray([0], jnp.int32)), Decoding(cfg, dcfg))
    assert outputs(st) == plain_greedy(target, [PROMPTS[2], PROMPTS[1]], 20)
    assert int(st.committed[0]) == 19  # the first token comes from prefill


def test_speculative_continuous_batching_answers_as_plain_greedy(target):
    """``decode.generate_until`` with a drafter stops once a row is done; that row, given the next prompt with
    ``decode.replace_rows``, and the row that kept running both answer as plain greedy decoding."""
    cfg, params = target
    dcfg, dparams = drafter_for(cfg)
    st = decode.prefill(Params(params, dparams), decode.init_state(Decoding(cfg, dcfg), PROMPTS[:2], 64, [6, 20]), Decoding(cfg, dcfg), 4)
    st = decode.generate_until(Params(params, dparams), st, Decoding(cfg, dcfg), jnp.int32(1))
    done, first = jax.device_get(st.done), outputs(st)[0]
    assert done.tolist() == [True, False]  # row 1 was still running when the call returned
    assert first == plain_greedy(target, [PROMPTS[0]], 6)[0]
    fresh = decode.prefill(Params(params, dparams), decode.init_state(Decoding(cfg, dcfg), [PROMPTS[2]], 64, 20), Decoding(cfg, dcfg), 4)
    st = decode.generate_until(Params(params, dparams), decode.replace_rows(st, fresh, jnp.asarray([0], jnp.int32)), Decoding(cfg, dcfg), jnp.int32(2))
    assert jax.device_get(st.done).all()
    assert outputs(st) == plain_greedy(target, [PROMPTS[2], PROMPTS[1]], 20)
