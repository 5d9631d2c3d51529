"""Adaptive verify depth (``n_max="auto"``): losslessness with every width and the plain step,
scripted acceptance, the width rule against a NumPy statement of it, the measured and kept cost
model, the API and its errors. Exactness of sampling with ``auto``: test_spec.py's chi-square.

Oracles: plain greedy decoding (itself checked against a no-cache recomputation), drafts taken
from the target's greedy continuation (acceptance known in advance), the policy's formula
written out in NumPy.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import driver
from dflash_jax.decode.auto import costs
from dflash_jax.decode import loop as decode
from dflash_jax.decode.auto.costs import CostModel, depth_policy
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.decode.auto import adaptive, policy as depth
from dflash_jax.decode.auto.policy import MAX_BACKOFF, Calibration
from dflash_jax.testing import tiny_drafter, tiny_target, verify_scripted

PROMPTS = [[5, 9, 17, 3, 22, 8, 1], [40, 2, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 30, 31]]
N = 3  # drafted tokens of the tiny drafter (block size 4)
WIDTHS = depth.verify_widths(N)  # (1, 3): the widths an adaptive step chooses from
CHOOSE = jax.jit(depth.choose_width)  # one compile for every policy (traced) of batch 4


@pytest.fixture(scope="module")
def pair():
    cfg, params = tiny_target("qwen3", seed=3, num_hidden_layers=2)  # few layers: little to compile
    dcfg, dparams = tiny_drafter(cfg, seed=0, block_size=N + 1, layer_ids=(0, 1), num_hidden_layers=1)
    return cfg, params, dcfg, dparams


def outputs(st):
    toks, plen, length = jax.device_get((st.tokens, st.prompt_len, st.length))
    return [[int(t) for t in toks[b, plen[b] : length[b]]] for b in range(toks.shape[0])]


def plain_greedy(pair, prompts, n_new, max_len=64):
    cfg, params = pair[:2]
    static, weights = Decoding(cfg), Params(params)
    st = decode.prefill(weights, decode.init_state(static, prompts, max_len, n_new), static, 4)
    return outputs(decode.decode_loop(weights, st, static))


def run_auto(pair, prompts, n_new, model: CostModel, calibration=None, sampling=dj.SamplingConfig(), seed=0, max_backoff=MAX_BACKOFF):
    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(calibration or Calibration.identity(N), model, max_backoff=max_backoff))
    st = decode.prefill(weights, decode.init_state(static, prompts, 64, n_new, seed=seed, sampling=sampling), static, 4)
    return decode.decode_loop(weights, st, static)


# a confident calibration (acceptance about 0.8 at any confidence) and costs that grow with the
# width: the chosen width then depends on how many drafts a shortened final block may hold
CONFIDENT = Calibration((0.0,) * N, (1.4,) * N)
GROWING = CostModel(step_cost=((1.3, 1.7),), plain_cost=(1.0,), widths=WIDTHS)


def test_greedy_lossless_with_every_forced_width_and_the_plain_step(pair):
    """One compiled loop serves every width (the policy is traced) and each is lossless; rows of
    one batch keep their own acceptance."""
    from dflash_jax.runtime.compiled import count_compilations

    prompts, ref = PROMPTS, plain_greedy(pair, PROMPTS, 20)
    run_auto(pair, prompts, 20, CostModel.forcing(N, 1))  # warm-up
    with count_compilations() as compiled:
        for w in WIDTHS:
            st = run_auto(pair, prompts, 20, CostModel.forcing(N, w))
            assert outputs(st) == ref
            widths = np.asarray(st.speculative.widths)
            assert widths[w] == int(st.steps) and widths.sum() == widths[w], (w, widths)
        st = run_auto(pair, prompts, 20, GROWING, CONFIDENT)
        assert outputs(st) == ref
        st = run_auto(pair, prompts, 20, CostModel.never_pays(N))
        assert outputs(st) == ref
    assert compiled() == 0


def test_continuous_batching_with_auto_answers_as_plain_greedy(pair):
    """``generate_until`` under ``auto`` stops once a row is done; that row, given a new prompt with
    ``replace_rows``, and the rows that kept running answer as plain greedy decoding."""
    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(CONFIDENT, GROWING))
    st = decode.prefill(weights, decode.init_state(static, PROMPTS, 64, [6, 20, 20]), static, 4)
    st = decode.generate_until(weights, st, static, jnp.int32(1))
    assert bool(st.done[0]) and outputs(st)[0] == plain_greedy(pair, PROMPTS, 6)[0]
    fresh = decode.prefill(weights, decode.init_state(static, [PROMPTS[1]], 64, 20), static, 4)
    st = decode.decode_loop(weights, decode.replace_rows(st, fresh, jnp.asarray([0], jnp.int32)), static)
    assert outputs(st) == plain_greedy(pair, [PROMPTS[1], PROMPTS[1], PROMPTS[2]], 20)


@pytest.mark.parametrize("cap", [MAX_BACKOFF, 2])
def test_plain_steps_follow_the_backoff_schedule(pair, cap):
    """Drafting never pays: proposes alternate with plain runs of 1, 2, 4, ... steps up to the
    policy's ``max_backoff``, and plain steps commit one token each (the drafter context still
    follows: output unchanged)."""
    st = run_auto(pair, [PROMPTS[2]] * 3, 40, CostModel.never_pays(N), max_backoff=cap)
    assert outputs(st) == plain_greedy(pair, [PROMPTS[2]] * 3, 40)
    steps, proposes = int(st.steps), int(np.asarray(st.speculative.widths).sum())
    runs, total, k = [], 0, 1  # the schedule: propose, then k plain steps, k doubling
    while total < steps:
        total += 1
        runs.append(min(k, steps - total))
        total += runs[-1]
        k = min(2 * k, cap)
    assert proposes == len(runs) and steps - proposes == sum(runs)
    assert driver.spec_stats(st)["plain_steps"] == steps - proposes > proposes


def test_the_longest_plain_run_follows_the_measured_costs():
    """By default the cap of the backoff makes a propose whose drafts are all rejected cost at most
    PROBE_LOSS of plain speed: MAX_BACKOFF where drafting is cheap, ceil((C / C_plain - 1) /
    PROBE_LOSS) of the cheapest width in the worst bucket between, MAX_BACKOFF_LIMIT at most."""
    cheap = CostModel(step_cost=((1.05, 1.2),), plain_cost=(1.0,), widths=WIDTHS)
    dear = CostModel(step_cost=((2.42, 3.0),), plain_cost=(1.0,), widths=WIDTHS)
    buckets = CostModel(step_cost=((1.05, 1.2), (0.03, 0.04)), plain_cost=(1.0, 0.02), widths=WIDTHS, bounds=(128, 1024))
    assert costs.probe_backoff(cheap) == MAX_BACKOFF
    assert costs.probe_backoff(dear) == 142  # ceil(1.42 / 0.01)
    assert costs.probe_backoff(buckets) == 50  # the second bucket's 1.5 plain steps
    assert costs.probe_backoff(CostModel.never_pays(N)) == depth.MAX_BACKOFF_LIMIT
    assert int(depth_policy(Calibration.identity(N), dear).max_backoff) == 142
    assert int(depth_policy(Calibration.identity(N), dear, max_backoff=3).max_backoff) == 3


def test_a_plain_step_of_the_adaptive_step_commits_the_target_token_and_nothing_else(pair):
    """The adaptive step's plain branch: one token, plain greedy decoding's; one plain step of the
    schedule used; the widths, the drafts' counts and each row's trust untouched."""
    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(CONFIDENT, GROWING))
    st = decode.prefill(weights, decode.init_state(static, PROMPTS, 64, 8), static, 4)
    st = st.replace(speculative=st.speculative.replace(plain_left=jnp.full_like(st.speculative.plain_left, 2),
                                                       trust=jnp.asarray([0.5, 1.0, 1.5], jnp.float32)))
    before = jax.device_get(st.speculative)
    length = np.asarray(st.length)
    after = adaptive.verify_auto(weights, st, static, jnp.zeros((3, N), jnp.int32), jnp.full((3, N), 0.99, jnp.float32), plain=True)
    ref = plain_greedy(pair, PROMPTS, 2)
    assert [o[:2] for o in outputs(after)] == ref and (np.asarray(after.length) == length + 1).all()
    ctx = jax.device_get(after.speculative)
    assert int(ctx.plain_left) == int(before.plain_left) - 1 and int(ctx.backoff) == int(before.backoff)
    np.testing.assert_array_equal(ctx.widths, before.widths)
    np.testing.assert_array_equal(ctx.drafted, before.drafted)
    np.testing.assert_array_equal(ctx.trust, before.trust)
    assert (np.asarray(ctx.verify_steps) == np.asarray(before.verify_steps) + 1).all()


def test_plain_steps_reach_the_drafter_context_through_the_pending_buffer(pair):
    """A plain step of ``auto`` writes its token's target features into the pending buffer, which
    is projected into the drafter context when it holds PENDING_ROWS rows and before every
    propose: after each step the context holds, at every position before the pending rows, what a
    prefill of the same tokens projects (float rounding apart), a drafting step leaves nothing
    pending, and after the last projection the whole context before each anchor agrees."""
    from dflash_jax.decode.state import PENDING_ROWS

    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(Calibration.identity(N), CostModel.never_pays(N), max_backoff=32))
    st = decode.prefill(weights, decode.init_state(static, PROMPTS, 64, [12, 45, 45]), static, 4)
    assert np.asarray(st.speculative.pending).shape == (3, PENDING_ROWS, 2 * cfg.hidden_size)
    seen, proposes = set(), 0
    while not bool(jnp.all(st.done)):
        n_before, running = np.asarray(st.speculative.pending_n), ~np.asarray(st.done)
        st = decode.decode_step(weights, st, static)
        n, drafted = np.asarray(st.speculative.pending_n), int(np.asarray(st.speculative.widths).sum())
        if drafted > proposes:  # a drafting step: the pending rows were projected before its propose
            assert (n[running] == 0).all(), n
            proposes = drafted
        else:  # a plain step: one more row pending in each running row, projected at PENDING_ROWS
            want = np.where(running, n_before + 1, n_before)
            assert (n == np.where((want >= PENDING_ROWS).any(), 0, want)).all(), (n_before, n)
        seen.update(int(x) for x in n)
    assert PENDING_ROWS - 1 in seen and proposes >= 4  # a full buffer and plain runs that ended in a propose

    def prefilled_context(st):  # a prefill of each row's committed tokens before its anchor
        toks, length = jax.device_get((st.tokens, st.length))
        seqs = [[int(t) for t in toks[b, : length[b] - 1]] for b in range(toks.shape[0])]
        return decode.prefill(weights, decode.init_state(static, seqs, 64, 1), static, 4).speculative.context

    def agrees(ctx, ref, st, pending):
        length = np.asarray(st.length)
        for b in range(length.shape[0]):
            upto = length[b] - 1 - pending[b]
            for got, want in ((ctx.k, ref.k), (ctx.v, ref.v)):
                np.testing.assert_allclose(np.asarray(got)[:, b, :upto], np.asarray(want)[:, b, :upto], rtol=1e-5, atol=1e-5)

    ref = prefilled_context(st)
    agrees(st.speculative.context, ref, st, np.asarray(st.speculative.pending_n))
    assert np.asarray(st.speculative.pending_n)[1:].max() > 0  # the last rows end with rows pending
    st = jax.jit(adaptive.absorb_pending, static_argnames="static")(weights, st, static)
    agrees(st.speculative.context, ref, st, np.zeros(3, int))
    assert outputs(st) == plain_greedy(pair, PROMPTS, [12, 45, 45])


def scripted(pair, prompt, n_new, width, corrupt_at=None, conf=0.9):
    """Verifies drafts taken from the greedy continuation (wrong at ``corrupt_at``) at a forced
    width, through :func:`adaptive.verify_auto`, in three equal rows (the shapes of the other
    tests: nothing more to compile); returns the state and each step's acceptance of row 0."""
    cfg, params, dcfg, dparams = pair
    full = list(prompt) + plain_greedy(pair, [prompt] * 3, n_new + N)[0]
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(Calibration.identity(N), CostModel.forcing(N, width)))
    st = decode.prefill(weights, decode.init_state(static, [prompt] * 3, 64, n_new), static, 4)
    def verify(s, drafts):
        return adaptive.verify_auto(weights, s, static, jnp.asarray([drafts] * 3, jnp.int32), jnp.full((3, N), conf, jnp.float32))

    st, accepts = verify_scripted(st, full, N, verify, corrupt_at, cfg.vocab_size)
    return st, accepts, full[len(prompt) : len(prompt) + n_new]


@pytest.mark.parametrize("width", WIDTHS)
def test_scripted_full_acceptance_commits_width_plus_one(pair, width):
    st, accepts, ref = scripted(pair, PROMPTS[0], 1 + 4 * (width + 1), width)
    assert outputs(st)[0] == ref
    assert accepts == [width] * 4 and int(st.committed[0]) == 4 * (width + 1)  # widths: batch steps
    assert np.asarray(st.speculative.widths).tolist() == [4 if w == width else 0 for w in range(N + 1)]


@pytest.mark.parametrize("width,j", [(3, 0), (3, 1), (1, 0), (1, 2), (3, 2)])
def test_scripted_rejection_at_j_accepts_min_of_j_and_width(pair, width, j):
    st, accepts, ref = scripted(pair, PROMPTS[1], 16, width, corrupt_at=j)
    assert outputs(st)[0] == ref
    assert all(a == min(j, width) for a in accepts[:-1])  # the last step may be cut by the budget
    per_pos = np.asarray(st.speculative.accepted_per_position[0])
    assert (per_pos[min(j, width):] == 0).all()


def test_a_row_whose_drafts_are_always_rejected_drops_to_plain_steps_within_three_steps(pair):
    """Online acceptance: confident drafts (calibrated acceptance 0.8) that are always wrong pay
    at first (batch 3, costs 1.3 / 1.7 against 1.0 plain); each step halves the rows' trust and
    the third propose no longer pays, so the schedule turns to plain steps. Drafts that are
    always right raise the trust above 1. Output is the target's greedy answer throughout."""
    cfg, params, dcfg, dparams = pair
    prompt = PROMPTS[0]
    full = list(prompt) + plain_greedy(pair, [prompt] * 3, 12 + N)[0]
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(CONFIDENT, GROWING))
    for corrupt_at, steps in ((0, 3), (None, 2)):
        st = decode.prefill(weights, decode.init_state(static, [prompt] * 3, 64, 12), static, 4)
        plain_left, trust = [], []
        for _ in range(steps):
            length = int(st.length[0])
            drafts = [full[length + i] for i in range(N)]
            if corrupt_at is not None:
                drafts[corrupt_at] = (drafts[corrupt_at] + 1) % cfg.vocab_size
            st = adaptive.verify_auto(weights, st, static, jnp.asarray([drafts] * 3, jnp.int32), jnp.full((3, N), 0.9, jnp.float32))
            plain_left.append(int(st.speculative.plain_left))
            trust.append(np.asarray(st.speculative.trust).tolist())
        assert outputs(st)[0] == full[len(prompt) : int(st.length[0])]
        if corrupt_at == 0:
            assert plain_left == [0, 0, 1]  # paid, paid, then a plain step scheduled
            np.testing.assert_allclose(trust, [[0.5] * 3, [0.25] * 3, [0.125] * 3])
        else:
            assert plain_left == [0, 0] and all(t > 1.2 for t in trust[-1])


def width_oracle(scale, bias, step_cost, plain_cost, margin, conf, n_valid, running):
    """The rule of :mod:`dflash_jax.decode.auto.policy`, in NumPy."""
    c = np.clip(conf, 1e-6, 1 - 1e-6)
    a = 1 / (1 + np.exp(-(scale * np.log(c / (1 - c)) + bias)))
    surv = np.cumprod(a, axis=1) * (np.arange(conf.shape[1])[None] < n_valid[:, None])
    e = 1 + np.concatenate([np.zeros((len(c), 1)), np.cumsum(surv, axis=1)], axis=1)
    rate = e[running].sum(0)[list(WIDTHS)] / step_cost
    return int(np.argmax(rate)), bool(rate.max() * plain_cost > (1 + margin) * running.sum())


def test_verify_widths_are_blocks_of_powers_of_two_and_the_whole_block():
    assert [depth.verify_widths(n) for n in (1, 2, 3, 5, 7, 15)] == [(1,), (1, 2), (1, 3), (1, 3, 5), (1, 3, 7), (1, 3, 7, 15)]
    with pytest.raises(DFlashError, match="at least 1"):
        depth.verify_widths(0)
    with pytest.raises(DFlashError, match=r"^width: got 2 \(expected one of the verify widths \(1, 3\)"):
        CostModel.forcing(N, 2)


def test_a_row_s_trust_widens_the_verify_above_one_and_drops_it_to_plain_below():
    """Issue 49's two directions, in the choice itself: at confidences where the calibrated
    prediction alone verifies 1 draft (costs 1.3 / 1.7 against 1.0 plain), a trust of 2 (drafts
    accepted twice as often as predicted) verifies 3, and a trust of 1/4 takes a plain step."""
    policy = depth_policy(Calibration.identity(N), GROWING)
    conf = jnp.full((1, N), 0.5, jnp.float32)
    expected = depth.expected_tokens(policy, conf, jnp.asarray([N], jnp.int32))
    got = {}
    for trust in (0.25, 1.0, 2.0):
        j, pays = depth.choose_from(policy, depth.trusted(expected, jnp.asarray([trust], jnp.float32)), jnp.asarray([True]), jnp.int32(20), WIDTHS)
        got[trust] = WIDTHS[int(j)] if bool(pays) else 0
    assert got == {0.25: 0, 1.0: 1, 2.0: 3}


def test_width_rule_matches_its_numpy_statement():
    rng = np.random.default_rng(0)
    chosen = set()
    for _ in range(40):
        b = 4
        conf = rng.uniform(0.01, 0.99, (b, N)).astype(np.float32)
        n_valid, running = rng.integers(0, N + 1, b), rng.random(b) < 0.8
        running[0] = True
        scale, bias = rng.uniform(0.5, 1.5, N).astype(np.float32), rng.uniform(-1, 1, N).astype(np.float32)
        step_cost = np.sort(rng.uniform(1.0, 2.0, len(WIDTHS))).astype(np.float32)
        plain_cost, margin = np.float32(rng.uniform(0.7, 1.2)), float(rng.choice([0.0, depth.PAY_MARGIN, 0.3]))
        model = CostModel(step_cost=(tuple(step_cost),), plain_cost=(float(plain_cost),), widths=WIDTHS)
        policy = depth_policy(Calibration(tuple(scale), tuple(bias)), model, pay_margin=margin)
        w, pays = CHOOSE(policy, jnp.asarray(conf), jnp.asarray(n_valid, jnp.int32), jnp.asarray(running), jnp.int32(20))
        assert (int(w), bool(pays)) == width_oracle(scale, bias, step_cost, plain_cost, np.float32(margin), conf, n_valid, running)
        chosen.add(int(w))
    assert chosen == {0, 1}, f"the trials should reach every width, got {chosen}"


def test_cost_buckets_follow_the_longest_live_row():
    model = CostModel(step_cost=((1, 1), (1, 9)), plain_cost=(5, 5), widths=WIDTHS, bounds=(16, costs.NEVER))
    policy = depth_policy(Calibration.identity(N), model)
    conf, n_valid, running = jnp.full((4, N), 0.9), jnp.full((4,), N, jnp.int32), jnp.ones((4,), bool)
    assert int(CHOOSE(policy, conf, n_valid, running, jnp.int32(16))[0]) == len(WIDTHS) - 1
    assert int(CHOOSE(policy, conf, n_valid, running, jnp.int32(17))[0]) == 0


def test_missing_or_misshapen_policy_and_bad_cost_models_are_named(pair):
    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto")
    assert static.adaptive and static.depth == N and static.width == N + 1
    st = decode.prefill(Params(params, dparams), decode.init_state(static, PROMPTS, 64, 4), static, 4)  # no policy needed
    with pytest.raises(DFlashError, match="params.depth"):
        decode.decode_loop(Params(params, dparams), st, static)
    short = depth_policy(Calibration.identity(2), CostModel.forcing(2, 1))
    with pytest.raises(DFlashError, match=r"params.depth.scale: shape \(2,\)"):
        decode.decode_loop(Params(params, dparams, short), st, static)
    with pytest.raises(DFlashError, match="cost_model: prices 3 drafted tokens"):
        depth_policy(Calibration.identity(2), CostModel.forcing(N, 1))
    cut = depth_policy(Calibration((0.5, 1.0, 2.0), (0.1, 0.2, 0.3)), CostModel.forcing(1, 1))  # auto over fewer drafts
    np.testing.assert_allclose(cut.scale, [0.5])
    np.testing.assert_allclose(cut.bias, [0.1])
    for name, bad in (("max_backoff", 0), ("max_backoff", 2.5), ("max_backoff", True), ("max_backoff", 2**31), ("pay_margin", -0.1),
                      ("pay_margin", float("nan")), ("pay_margin", 1e39)):
        with pytest.raises(DFlashError, match=f"^{name}: got"):
            depth_policy(Calibration.identity(N), CostModel.forcing(N, 1), **{name: bad})
    short = depth_policy(Calibration.identity(N), CostModel.forcing(N, 1))
    with pytest.raises(DFlashError, match="^pay_margin: got -1"):
        costs.with_constants(short, pay_margin=-1)
    other = costs.with_constants(short, max_backoff=np.int64(3), pay_margin=np.float32(0.5))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), other) == jax.tree.map(lambda x: (x.shape, x.dtype), short)
    kept = costs.with_constants(other, pay_margin=0.25)  # the constant not given stays the policy's
    assert (int(kept.max_backoff), float(kept.pay_margin)) == (3, 0.25)
    with pytest.raises(DFlashError, match=r"params.depth.max_backoff: shape \(2,\)"):
        decode.decode_loop(Params(params, dparams, short.replace(max_backoff=jnp.ones(2, jnp.int32))), st, static)
    for bad in (dict(step_cost=((1.0, -1.0),), plain_cost=(1.0,), widths=WIDTHS),
                dict(step_cost=((1.0, 2.0), (1.0,)), plain_cost=(1.0, 1.0), widths=WIDTHS, bounds=(4, 8)),
                dict(step_cost=((1.0, 2.0),), plain_cost=(1.0,), widths=WIDTHS, bounds=(0, 0)),
                dict(step_cost=((1.0, 2.0),), plain_cost=(1.0,), widths=(1, 2, 3)), dict(step_cost=((1.0, 2.0),), plain_cost=(1.0,), widths=(1,))):
        with pytest.raises(DFlashError, match="cost_model"):
            CostModel(**bad)
    with pytest.raises(DFlashError, match="--n-max"):
        Decoding(cfg, dcfg, n_max="deep")
    with pytest.raises(DFlashError, match="without a drafter"):
        Decoding(cfg, n_max="auto")


@pytest.fixture(scope="module")
def api_pair(pair):
    cfg, params, dcfg, dparams = pair
    target = dj.Target(cfg=cfg, params=params, tokenizer=None, source="tiny-target", eos_ids=())
    return target, dj.Drafter(cfg=dcfg, params=dparams, source="tiny-drafter", n_max="auto", calibration=CONFIDENT)


def test_the_schedule_goes_on_from_the_last_generation_of_the_same_key(api_pair):
    """A generation under ``auto`` starts from the schedule the last one of the same pair, batch
    size, settings and costs ended with (decode/auto/history.py): under costs where drafting never
    pays the second answer inherits the long plain run and proposes less, the output stays plain
    greedy decoding's, another batch size starts afresh and ``forget`` clears what is kept."""
    from dflash_jax.decode.auto import history
    target, drafter = api_pair
    history.forget()
    never = CostModel.never_pays(N)
    plain = dj.generate(target, PROMPTS, max_new_tokens=24)
    first = dj.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter, cost_model=never)
    assert first.stats["schedule_from"] is None and first.output_ids == plain.output_ids
    # proposes at steps 0, 2, 5, 10 and 19 (plain runs of 1, 2, 4, 8, then 16 cut by the budget)
    assert sum(first.stats["widths"]) == 5
    second = dj.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter, cost_model=never)
    kept = second.stats["schedule_from"]
    assert kept["backoff"] == 32 and 1 <= kept["plain_left"] <= 16 and 0 <= kept["trust"] <= depth.TRUST_MAX
    assert second.output_ids == plain.output_ids
    assert sum(second.stats["widths"]) == 1  # the rest of the run of 16, a propose, then a run of 32
    assert dj.generate(target, PROMPTS[:2], max_new_tokens=24, drafter=drafter, cost_model=never).stats["schedule_from"] is None
    history.forget()
    assert dj.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter, cost_model=never).stats["schedule_from"] is None


def test_rows_joining_a_served_batch_start_from_its_running_rows_trust(pair):
    """A request's rows join a running batch with the mean trust of its running rows (the
    server's counterpart of a generation going on from the last one); with none running, of all
    its rows."""
    from dflash_jax.decode.auto import history
    from dflash_jax.decode.state import STOP
    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto")
    st = decode.init_state(static, [PROMPTS[0]] * 3, 64, 8)
    st = st.replace(speculative=st.speculative.replace(trust=jnp.asarray([0.2, 0.6, 1.6], jnp.float32)),
                    finish=st.finish.at[2].set(STOP))
    joined = history.joining(st, decode.init_state(static, [PROMPTS[1]] * 2, 64, 8))
    np.testing.assert_allclose(np.asarray(joined.speculative.trust), [0.4, 0.4], rtol=1e-6)
    idle = st.replace(finish=jnp.full_like(st.finish, STOP))
    np.testing.assert_allclose(np.asarray(history.joining(idle, decode.init_state(static, [PROMPTS[1]], 64, 8)).speculative.trust), [0.8],
                               rtol=1e-6)


def test_generate_measures_keeps_and_refreshes_the_cost_model(api_pair, tmp_path, monkeypatch, capsys):
    """The API's default under a drafter recorded with ``auto``: costs measured once per
    (device, pair, batch size), whatever the capacity or streaming, saying so on stderr, read back from the cache folder,
    measured again on ``"refresh"``; stats report widths and plain steps; output equals plain
    greedy."""
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASH_JAX_PROGRESS", raising=False)
    monkeypatch.setattr(costs, "STABLE", 100.0)  # the tiny pair's steps take a millisecond: timer noise
    target, drafter = api_pair
    plain = dj.generate(target, PROMPTS, max_new_tokens=12)
    capsys.readouterr()
    first = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter)
    assert "dflash_jax: measured the step costs of n_max auto in " in capsys.readouterr().err
    assert first.output_ids == plain.output_ids
    st = first.stats
    assert st["n_max"] == "auto" and st["cost_model"] == "measured" and st["cost_model_s"] > 0
    assert len(st["widths"]) == N + 1 and sum(st["widths"]) + st["plain_steps"] == st["steps"]
    assert len(st["step_cost_ms"]) == len(WIDTHS) and st["cost_widths"] == list(WIDTHS) and st["plain_cost_ms"] > 0
    kept = list((tmp_path / "depth_costs").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["key"]["batch"] == 3
    from dflash_jax.runtime.compiled import source_hash  # another version of the step measures again
    assert json.loads(kept[0].read_text())["key"]["package"] == source_hash()[:16]
    again = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter)
    assert again.stats["cost_model"] == "cached" and again.stats["step_cost_ms"] == st["step_cost_ms"]
    assert "step costs" not in capsys.readouterr().err
    entry = json.loads(kept[0].read_text())
    kept[0].write_text(json.dumps(dict(entry, step_cost=[[0.1, 0.2, 0.3]], widths=[1, 3, 7])))  # a valid model of another depth
    healed = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter)
    assert healed.stats["cost_model"] == "measured" and len(json.loads(kept[0].read_text())["step_cost"][0]) == len(WIDTHS)
    key = entry["key"]
    fresh = CostModel.forcing(N, 1)
    remeasured = costs.cost_model_for(key, lambda: dataclasses.replace(fresh, info=dict(source="measured")), refresh=True)
    assert remeasured.step_cost == fresh.step_cost and costs.load_cached(key).step_cost == fresh.step_cost  # "refresh"
    given = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter, cost_model=CostModel.forcing(N, 1))
    assert given.stats["cost_model"] == "given" and given.stats["widths"][1] == given.stats["steps"]
    streamed = []
    capsys.readouterr()
    res = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter, on_tokens=streamed.append, max_len=128)
    # streamed, another capacity: the same machine, pair and batch size, so the same costs
    assert res.output_ids == plain.output_ids and res.stats["cost_model"] == "cached"
    assert "step costs" not in capsys.readouterr().err


def test_a_measurement_that_did_not_settle_is_used_once_and_not_kept(api_pair, tmp_path, monkeypatch, capsys):
    """A busy machine's timings (here: a settling bound nothing meets) decide this run only: the
    next run measures again, and stderr says why."""
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASH_JAX_PROGRESS", raising=False)
    monkeypatch.setattr(costs, "STABLE", -1.0)
    target, drafter = api_pair
    for source in ("measured", "unkept", "measured"):  # this process reuses it a while, then measures again
        res = dj.generate(target, PROMPTS, max_new_tokens=6, drafter=drafter)
        assert res.stats["cost_model"] == source
        assert ("the timings did not settle (a busy machine?): used now, not kept" in capsys.readouterr().err) == (source == "measured")
        monkeypatch.setattr(costs, "REMEASURE_S", 0.0 if source == "unkept" else costs.REMEASURE_S)
    assert not list((tmp_path / "depth_costs").glob("*.json"))


class _Clocks:
    """A fake wall clock and process CPU clock: each wall reading moves 1 s on, the CPU clock
    ``share`` s on (other processes took the rest)."""

    def __init__(self, share):
        self.share, self.wall, self.cpu = share, 0.0, 0.0

    def wall_clock(self):
        self.wall += 1.0
        return self.wall

    def cpu_clock(self):
        self.cpu += self.share
        return self.cpu


@pytest.mark.parametrize("share,kept", [(0.3, False), (1.6, True)])
def test_a_measurement_taken_while_the_machine_was_busy_is_not_kept(api_pair, tmp_path, monkeypatch, capsys, share, kept):
    """Timings during which the process got 0.3 CPU seconds per second (steady load: they settle
    all the same) decide this run only and are measured again next run; a process that had its
    cores (1.6) keeps them."""
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("DFLASH_JAX_BUSY_SHARE", "0.75")
    monkeypatch.delenv("DFLASH_JAX_PROGRESS", raising=False)
    clocks = _Clocks(share)
    monkeypatch.setattr(costs, "_clock", clocks.wall_clock)
    monkeypatch.setattr(costs, "_cpu_clock", clocks.cpu_clock)
    target, drafter = api_pair
    for run in range(2):
        res = dj.generate(target, PROMPTS, max_new_tokens=6, drafter=drafter)
        err = capsys.readouterr().err
        assert res.stats["cost_model"] == ("measured" if not run else "cached" if kept else "unkept")
        assert ("the machine was busy (this process had 0.3 CPU seconds per second): used now, not kept" in err) == (not kept and not run)
    assert len(list((tmp_path / "depth_costs").glob("*.json"))) == int(kept)
    monkeypatch.setenv("DFLASH_JAX_BUSY_SHARE", "lots")
    with pytest.raises(DFlashError, match="DFLASH_JAX_BUSY_SHARE: got 'lots'"):
        dj.generate(target, PROMPTS, max_new_tokens=6, drafter=drafter, cost_model="refresh")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n_max=2, cost_model="refresh"), "cost_model (--measure-costs): given with n_max 2"),
    (dict(cost_model="again"), "cost_model: got 'again'"),
    (dict(cost_model=CostModel.forcing(2, 1)), "cost_model: prices the verify widths (1, 2)"),
])
def test_bad_cost_model_arguments(api_pair, kwargs, needle):
    target, drafter = api_pair
    with pytest.raises(DFlashError) as e:
        dj.generate(target, PROMPTS, max_new_tokens=4, drafter=drafter, **kwargs)
    assert str(e.value).startswith(needle)


def test_cost_model_without_a_drafter_is_named(api_pair):
    with pytest.raises(DFlashError, match=r"^cost_model \(--measure-costs\): given without a drafter"):
        dj.generate(api_pair[0], PROMPTS, max_new_tokens=4, cost_model="refresh")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(step_cost=[[0.1, 0.2]], plain_cost=0.1, widths=WIDTHS), "cost_model.plain_cost: got 0.1"),
    (dict(step_cost=[0.1, 0.2], plain_cost=[0.1], widths=WIDTHS), "cost_model.step_cost: got [0.1, 0.2]"),
    (dict(step_cost=[["a", 0.2]], plain_cost=[0.1], widths=WIDTHS), "cost_model.step_cost"),
    (dict(step_cost=[[0.1, 0.2]], plain_cost=[0.1], widths=WIDTHS, bounds="16"), "cost_model.bounds"),
    (dict(step_cost=[[0.1, 0.2]], plain_cost=[0.1], widths="13"), "cost_model.widths: got '13'"),
])
def test_cost_models_of_the_wrong_types_are_named(kwargs, needle):
    with pytest.raises(DFlashError) as e:
        CostModel(**kwargs)
    assert str(e.value).startswith(needle)


def test_recorded_calibration_is_loaded_and_checked(api_pair, tmp_path):
    from dflash_jax.train.export import export_drafter

    target, drafter = api_pair
    export_drafter(tmp_path, drafter.cfg, drafter.params, dtype="float32")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_jax"] = dict(n_max="auto", depth_calibration=dict(scale=[1.0, 0.5, 2.0], bias=[0.0, 0.1, -0.2], method="test"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = dj.load_drafter(tmp_path, target)
    assert d.n_max == "auto" and d.calibration == Calibration((1.0, 0.5, 2.0), (0.0, 0.1, -0.2))
    assert d.calibration.record["method"] == "test"
    assert d.auto_depth is None
    cfg["dflash_jax"]["auto_depth"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = dj.load_drafter(tmp_path, target)
    res = dj.generate(target, [[5, 9, 17]], max_new_tokens=6, drafter=d, cost_model=CostModel.forcing(1, 1))  # auto over one draft, as recorded
    assert d.auto_depth == 1 and res.stats["n_max"] == "auto" and len(res.stats["widths"]) == 2
    cfg["dflash_jax"]["auto_depth"] = drafter.cfg.block_size
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=rf"config.json: field dflash_jax.auto_depth: got {drafter.cfg.block_size}"):
        dj.load_drafter(tmp_path, target)
    del cfg["dflash_jax"]["auto_depth"]
    cfg["dflash_jax"]["depth_calibration"]["bias"] = [0.0, 0.1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=r"config.json: field dflash_jax.depth_calibration.bias: got \[0.0, 0.1\]"):
        dj.load_drafter(tmp_path, target)


def test_measure_times_every_width_and_the_plain_step(pair):
    """:func:`costs.measure` runs the given loop once per kind and round: it prices every verify
    width and the plain step, each from the loop's own step count."""
    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(Calibration.identity(N), CostModel.forcing(N, 1)))
    st = decode.prefill(weights, decode.init_state(static, PROMPTS, 64, 30), static, 4)
    seen = []

    def run(p, s):
        out = decode.generate_until(p, s, static, jnp.int32(3))
        seen.append(np.asarray(out.speculative.widths).tolist())
        return out

    kinds = len(WIDTHS) + 1
    model = costs.measure(run, weights, st, static, tokens=6, rounds=2, max_rounds=2)
    assert len(seen) == 2 * kinds and model.n == N and model.widths == WIDTHS and model.info["source"] == "measured"
    assert all(c > 0 for c in model.step_cost[0] + model.plain_cost)
    for i, widths in enumerate(seen[:kinds]):  # each forced kind ran only its own steps
        w = WIDTHS[i] if i < len(WIDTHS) else None
        assert sum(widths) == (0 if w is None else widths[w]) and (w is None or widths[w] > 0)
    done = st.replace(finish=jnp.ones_like(st.finish))
    assert costs.measure(run, weights, done, static).info["source"] == "none"
    seen.clear()
    lengths = []

    def run_at(p, s):
        lengths.append(int(jnp.max(s.length)))
        return run(p, s)

    model = costs.measure(run_at, weights, st, static, tokens=4, rounds=1, lengths=(16, 40), max_rounds=1)
    assert model.bounds == (16, 40) and len(model.step_cost) == 2 and len(model.plain_cost) == 2
    assert lengths == [16] * kinds + [40] * kinds  # each bucket priced with rows that long


def test_auto_over_fewer_drafts_than_the_block_is_lossless_and_checked(pair):
    """``auto_depth`` drafts fewer tokens than the block (one verify width, ``(1,)``, and the
    plain step): greedy output still equals plain greedy decoding; a bad ``auto_depth`` is named."""
    cfg, params, dcfg, dparams = pair
    static = Decoding(cfg, dcfg, n_max="auto", auto_depth=1)
    assert static.depth == 1 and static.width == 2
    policy = depth_policy(Calibration.identity(N), CostModel(step_cost=((1.3,),), plain_cost=(1.0,), widths=(1,)))
    st = decode.prefill(Params(params, dparams, policy), decode.init_state(static, PROMPTS, 64, 16), static, 4)
    st = decode.decode_loop(Params(params, dparams, policy), st, static)
    assert outputs(st) == plain_greedy(pair, PROMPTS, 16)
    assert np.asarray(st.speculative.widths).shape == (2,)
    for kw, match in ((dict(n_max=2, auto_depth=1), "auto_depth: got 1 with n_max=2"), (dict(n_max="auto", auto_depth=N + 1), "auto_depth: got 4"),
                      (dict(n_max="auto", auto_depth=0), "auto_depth: got 0")):
        with pytest.raises(DFlashError, match=match):
            Decoding(cfg, dcfg, **kw)
