"""Plain decoding: chunked prefill, on-device and streamed loops against a no-cache oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decode import loop as decode
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.state import CAPACITY, LENGTH, STOP
from dflash_jax.testing import reference_greedy, tiny_target

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=1)


def run(target, prompts, n_new, chunk, max_len=48, stop_ids=(), seed=0, sampling=GREEDY):
    params, cfg = target[1], target[0]
    st = decode.init_state(Decoding(cfg), prompts, max_len, n_new, stop_ids, seed, sampling)
    st = decode.prefill(Params(params), st, Decoding(cfg), chunk)
    return decode.decode_loop(Params(params), st, Decoding(cfg))


def outputs(st):
    toks, plen, length = jax.device_get((st.tokens, st.prompt_len, st.length))
    return [list(toks[b, plen[b] : length[b]]) for b in range(toks.shape[0])]


PROMPTS = [[5, 9, 17, 3, 22, 8, 1], [40, 2, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_batched_greedy_matches_no_cache_oracle(target, chunk):
    cfg, params = target
    st = run(target, PROMPTS, 10, chunk)
    want = [reference_greedy(params, cfg, p, 10) for p in PROMPTS]
    assert outputs(st) == want
    assert list(jax.device_get(st.finish)) == [LENGTH] * 3


def test_chunk_size_does_not_change_cache_or_gaps(target):
    a, b = run(target, PROMPTS, 6, 1), run(target, PROMPTS, 6, 5)
    np.testing.assert_allclose(np.asarray(a.gaps), np.asarray(b.gaps), rtol=1e-5, atol=1e-5)
    for la, lb in zip((a.cache.k, a.cache.v), (b.cache.k, b.cache.v)):
        n = int(jnp.min(a.length)) - 1  # committed cache slots
        np.testing.assert_allclose(np.asarray(la[:, :, :n]), np.asarray(lb[:, :, :n]), rtol=1e-5, atol=1e-5)


def test_stop_id_ends_row_inclusive(target):
    cfg, params = target
    free = reference_greedy(params, cfg, PROMPTS[0], 10)
    stop = free[4]
    st = run(target, [PROMPTS[0]], 10, 4, stop_ids=(stop,))
    out = outputs(st)[0]
    assert out == free[: free.index(stop) + 1]
    assert int(st.finish[0]) == STOP


def test_capacity_finish(target):
    st = run(target, [PROMPTS[0]], 100, 4, max_len=12)
    assert int(st.length[0]) == 12 and int(st.finish[0]) == CAPACITY


def test_stream_yields_same_tokens(target):
    cfg, params = target
    st = decode.init_state(Decoding(cfg), PROMPTS, 48, 7)
    st = decode.prefill(Params(params), st, Decoding(cfg), 4)
    got = [[] for _ in PROMPTS]
    for _, toks, counts in decode.stream(Params(params), st, Decoding(cfg)):
        for b, c in enumerate(counts):
            got[b] += list(toks[b, :c])
    assert got == [reference_greedy(params, cfg, p, 7) for p in PROMPTS]


def test_prompt_longer_than_capacity_is_an_error(target):
    with pytest.raises(DFlashError, match="--max-len"):
        decode.init_state(Decoding(target[0]), [list(range(20))], 20, 4)


def test_seeded_sampling_is_reproducible_and_varies_with_seed(target):
    cfg, params = target
    s = SamplingConfig(temperature=1.5, top_k=50, top_p=0.95)

    def go(seed):
        st = decode.init_state(Decoding(cfg), PROMPTS, 48, 12, seed=seed, sampling=s)
        st = decode.prefill(Params(params), st, Decoding(cfg), 4)
        return outputs(decode.decode_loop(Params(params), st, Decoding(cfg)))

    assert go(3) == go(3)
    assert go(3) != go(4)


def test_per_layer_parameters_give_the_stacked_results():
    """``unstack_layers`` (a Python loop over separate buffers, what ``load_target`` uses
    on CPU) computes what the stacked ``lax.scan`` computes: logits, K/V cache and captured
    features of a prefill, and the tokens of batched greedy and DFlash speculative decoding.
    One family: the layer loop (``run_layers``) is the same for every family, and the
    families' layer bodies are checked against transformers in test_parity_transformers.py."""
    from dflash_jax.runtime.carry import init_capture
    from dflash_jax.families.dense import model as dense
    from dflash_jax.nn.params import stack_layers
    from dflash_jax.nn.params import unstack_layers
    from dflash_jax.nn.params import PerLayer
    from dflash_jax.testing import tiny_drafter

    cfg, p = tiny_target("qwen2", seed=2)
    per = unstack_layers(p)
    assert isinstance(per["layers"], PerLayer) and len(per["layers"]) == cfg.num_hidden_layers
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), stack_layers(per), p))
    toks = jnp.asarray([PROMPTS[2]], jnp.int32)
    pos = jnp.arange(toks.shape[1], dtype=jnp.int32)[None]

    @jax.jit
    def prefill_outputs(params):
        cap = init_capture((0, 2), 1, 16, cfg.hidden_size, cfg.dtype)
        logits, cache, cap = dense.MODEL.forward(params, cfg, toks, pos, dense.MODEL.init_cache(cfg, 1, 16), cap)
        return logits, cache.k, cache.v, cap.hidden

    for a, b in zip(prefill_outputs(p), prefill_outputs(per)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # float32 summation order
    plain = outputs(run((cfg, p), PROMPTS, 12, 4))
    assert outputs(run((cfg, per), PROMPTS, 12, 4)) == plain
    dcfg, dp = tiny_drafter(cfg, layer_ids=(0, 2), block_size=4, seed=1)
    static = Decoding(cfg, dcfg)
    st = decode.init_state(static, PROMPTS, 48, 12)
    st = decode.decode_loop(Params(per, dp), decode.prefill(Params(per, dp), st, static, 4), static)
    assert outputs(st) == plain  # the stacked layout's DFlash run equals plain decoding in test_spec.py


def test_per_layer_layers_are_a_typed_pytree(target):
    """``unstack_layers`` gives a ``PerLayer``: ``jit``, ``tree_map``, pickling and the
    per-layer axes tree keep that type (key paths ``['layers'][i]`` as a tuple's), the store keys
    it apart from stacked layers, and a plain tuple of layer dicts is refused with a DFlashError
    (by ``is_per_layer`` and a forward pass alike) instead of being run as stacked layers."""
    import pickle

    from dflash_jax.runtime import compiled as executables
    from dflash_jax.families.dense import model as dense
    from dflash_jax.nn.params import unstack_layers
    from dflash_jax.nn.params import PerLayer, is_per_layer

    cfg, p = target
    per = unstack_layers(p)
    assert is_per_layer(per["layers"]) and not is_per_layer(p["layers"]) and not is_per_layer(None)
    for again in (jax.jit(lambda t: t)(per), jax.tree.map(lambda a: a + 0, per), pickle.loads(pickle.dumps(jax.device_get(per))),
                  jax.tree.unflatten(jax.tree.structure(per), jax.tree.leaves(per))):
        assert type(again["layers"]) is PerLayer and jax.tree.structure(again) == jax.tree.structure(per)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), again, per))
    assert type(per["layers"][1:]) is PerLayer and len(per["layers"][1:]) == cfg.num_hidden_layers - 1
    assert "['layers'][1]['wq']" in {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(per)}
    assert type(dense.MODEL.param_axes(cfg, per_layer=True)["layers"]) is PerLayer
    k = executables.key(dense.MODEL.forward, (per,))
    assert k == executables.key(dense.MODEL.forward, (unstack_layers(p),)) and k != executables.key(dense.MODEL.forward, (p,))
    plain = dict(per, layers=tuple(per["layers"]))
    with pytest.raises(DFlashError, match=rf'params\["layers"\]: a plain tuple of {cfg.num_hidden_layers} layers .*PerLayer'):
        is_per_layer(plain["layers"])
    toks = jnp.asarray([PROMPTS[1]], jnp.int32)
    with pytest.raises(DFlashError, match="PerLayer"):
        dense.MODEL.forward(plain, cfg, toks, jnp.arange(3, dtype=jnp.int32)[None], dense.MODEL.init_cache(cfg, 1, 8))


def test_continuous_batching_rows_answer_as_alone(target):
    """Rows refilled with new prompts while others keep decoding (``generate_until`` then
    ``replace_rows``) answer exactly as each prompt alone, and the untouched rows go on unchanged."""
    cfg, params = target
    prompts = PROMPTS + [[7, 7, 30], [2, 4, 6, 8, 10]]
    budgets = [3, 9, 12]
    st = decode.init_state(Decoding(cfg), PROMPTS, 48, budgets)
    st = decode.prefill(Params(params), st, Decoding(cfg), 4)
    st = decode.generate_until(Params(params), st, Decoding(cfg), jnp.int32(1))
    first = outputs(st)
    assert list(jax.device_get(st.done)) == [True, False, False]  # stopped as soon as one row ended
    fresh = decode.prefill(Params(params), decode.init_state(Decoding(cfg), prompts[3:], 48, [6, 5]), Decoding(cfg), 4)
    st = decode.replace_rows(st, fresh, jnp.asarray([0, 2], jnp.int32))
    st = decode.generate_until(Params(params), st, Decoding(cfg), jnp.int32(3))
    assert all(jax.device_get(st.done))
    got = outputs(st)
    assert first[0] == reference_greedy(params, cfg, PROMPTS[0], 3)
    assert got == [reference_greedy(params, cfg, p, n) for p, n in zip([prompts[3], PROMPTS[1], prompts[4]], [6, 9, 5])]
    assert list(jax.device_get(st.prompt_len)) == [3, 3, 5]


def test_replace_rows_refuses_a_state_of_another_shape(target):
    cfg, params = target
    st = decode.init_state(Decoding(cfg), PROMPTS, 48, 4)
    with pytest.raises(DFlashError, match=r"replace_rows fresh.*tokens.*\[1, 48\]"):
        decode.replace_rows(st, decode.init_state(Decoding(cfg), [[1, 2]], 40, 4), jnp.asarray([1], jnp.int32))


# one greedy row, then rows of each warp: temperature alone, with top-k, with top-p
MIXED = [GREEDY, SamplingConfig(1.0), SamplingConfig(0.8, top_k=5), SamplingConfig(1.2, top_p=0.9)]
MIXED_PROMPTS = PROMPTS + [[7, 7, 30]]
SEEDS = [3, 4, 5, 6]


def test_rows_of_one_batch_sample_with_their_own_settings(target):
    """Sampling settings are each row's (``init_state(sampling=[...])``): in a batch mixing greedy
    and sampled rows each row commits what its prompt commits alone with its seed and settings,
    the greedy row the no-cache greedy continuation, and the sampled rows something else. With
    a drafter (sampled proposals, greedy rows proposing the argmax) the batch commits the same."""
    from dflash_jax.testing import tiny_drafter

    cfg, params = target
    batch = outputs(run(target, MIXED_PROMPTS, 10, 4, seed=SEEDS, sampling=MIXED))
    alone = [outputs(run(target, [p], 10, 4, seed=[k], sampling=s))[0] for p, k, s in zip(MIXED_PROMPTS, SEEDS, MIXED)]
    greedy = [reference_greedy(params, cfg, p, 10) for p in MIXED_PROMPTS]
    assert batch == alone
    assert batch[0] == greedy[0] and all(batch[b] != greedy[b] for b in (1, 2, 3)), "the settings apply"
    dcfg, dp = tiny_drafter(cfg, layer_ids=(0, 2), block_size=4, seed=1)
    static = Decoding(cfg, dcfg, "sample")
    st = decode.init_state(static, MIXED_PROMPTS, 48, 10, seed=SEEDS, sampling=MIXED)
    assert outputs(decode.decode_loop(Params(params, dp), decode.prefill(Params(params, dp), st, static, 4), static)) == batch


def test_each_row_stops_at_its_own_stop_ids(target):
    """``init_state(stop_ids=[[...], ...])``: each row ends at the first of its own stop ids (lists
    of different lengths), not at another row's, though it generates them."""
    cfg, params = target
    fa, fb, fc = (reference_greedy(params, cfg, p, 12) for p in PROMPTS)
    stop_a, stop_b = fb[1], fa[4]  # each row's stop id is one the other row generates first
    assert fa.index(stop_b) < fa.index(stop_a) and fb.index(stop_a) < fb.index(stop_b)
    st = run(target, PROMPTS, 12, 4, stop_ids=[[stop_a], [stop_b], [fc[6], fc[2]]])
    assert outputs(st) == [fa[: fa.index(stop_a) + 1], fb[: fb.index(stop_b) + 1], fc[:3]]
    assert list(jax.device_get(st.finish)) == [STOP] * 3
    shared = run(target, PROMPTS[:2], 12, 4, stop_ids=[stop_a, stop_b])  # one list for every row
    assert outputs(shared) == [fa[: fa.index(stop_b) + 1], fb[: fb.index(stop_a) + 1]]
    with pytest.raises(DFlashError, match="stop_ids.*one list per prompt"):
        decode.init_state(Decoding(cfg), PROMPTS, 48, 4, [[1], [2]])


def test_sampling_settings_belong_to_init_state(target):
    """A SamplingConfig where ``Decoding`` took it before (third) names draft_mode and init_state;
    init_state refuses settings that are not one SamplingConfig or one per prompt."""
    cfg = target[0]
    with pytest.raises(DFlashError, match="draft_mode") as e:
        Decoding(cfg, None, SamplingConfig(0.7))
    assert "init_state" in str(e.value)
    for bad in ([GREEDY] * 2, {"temperature": 1.0}):
        with pytest.raises(DFlashError, match="sampling"):
            decode.init_state(Decoding(cfg), PROMPTS, 48, 4, sampling=bad)


@pytest.mark.parametrize("kw", [dict(max_new_tokens=2**40), dict(max_new_tokens=[4]), dict(max_new_tokens=4.5),
                                dict(stop_ids=[10**12]), dict(stop_ids=[-5])])
def test_init_state_refuses_values_beyond_int32_or_of_the_wrong_shape(kw):
    """Each names its argument (an int32 overflow once escaped as a bare OverflowError)."""
    cfg, _ = tiny_target("qwen3")
    with pytest.raises(DFlashError, match=next(iter(kw))):
        decode.init_state(Decoding(cfg), [[1, 2], [3]], 16, **{"max_new_tokens": 4, **kw})
    with pytest.raises(DFlashError, match="--top-k"):
        SamplingConfig(top_k=2**31)
