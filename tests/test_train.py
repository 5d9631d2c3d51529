"""The DFlash training objective, trainer, checkpoints and export (docs/specs/dflash.md section 3).

Every test uses tiny random models. The bug-kind tests follow docs/specs/bug_reports.md B52 and the
training gotchas of docs/specs/dflash.md 3.8.
"""

import csv
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.drafter import model as drafter
from dflash_jax.testing import tiny_drafter, tiny_target
from dflash_jax.train import objective
from dflash_jax.train import data as data_mod
from dflash_jax.train import features as features_mod
from dflash_jax.train.data import Batcher, FeatureCache, TokenDataset, cache_features, target_features
from dflash_jax.train.export import drafter_hf_config, export_drafter
from dflash_jax.train.trainer import TrainConfig, latest_checkpoint, lr_schedule, params_fingerprint, train

GAMMA = 7.0


@pytest.fixture(scope="module")
def models():
    t_cfg, t_params = tiny_target("llama", seed=0)
    d_cfg, d_params = tiny_drafter(t_cfg, layer_ids=(0, 2), block_size=8, seed=1, scale=0.2)
    return t_cfg, t_params, d_cfg, d_params


def make_batch(lengths, s, prompt=4, seed=0, width=128):
    """Right-padded random batch: prompt tokens unsupervised, padding junk with loss_mask 0."""
    rs = np.random.RandomState(seed)
    b = len(lengths)
    tokens = rs.randint(0, 127, (b, s)).astype(np.int32)  # junk in the padding too
    mask = np.zeros((b, s), np.float32)
    for r, n in enumerate(lengths):
        mask[r, prompt:n] = 1
    feats = rs.randn(b, s, width).astype(np.float32)
    return tokens, mask, feats


_loss_terms = jax.jit(objective.loss_terms, static_argnames=("cfg", "target_cfg", "gamma"))


def terms(models, tokens, mask, feats, anchors, valid):
    t_cfg, t_params, d_cfg, d_params = models
    return _loss_terms(d_params, d_cfg, t_params, t_cfg, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(feats),
                       jnp.asarray(anchors, jnp.int32), jnp.asarray(valid), GAMMA)


@pytest.fixture(scope="module")
def zref(models):
    """z-lab's PyTorch drafter (PyPI ``dflash==0.1.0``) holding the same weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    zlab = pytest.importorskip("dflash.model")
    from dflash_jax.train.export import drafter_tensors

    t_cfg, t_params, d_cfg, d_params = models
    model = zlab.DFlashDraftModel(transformers.Qwen3Config(**drafter_hf_config(d_cfg, "float32"))).eval().float()
    missing, unexpected = model.load_state_dict({k: torch.tensor(v) for k, v in drafter_tensors(d_cfg, d_params, "float32").items()}, strict=False)
    assert not unexpected and all(m.endswith("inv_freq") for m in missing)
    return model


def reference_block(models, zref, tokens, mask, feats, a, labels=None):
    """One block at anchor ``a``, written out by hand with z-lab's reference drafter: its
    ``target_hidden`` is explicitly the features of positions ``0 .. a-1`` and nothing else;
    slot ``k`` is labelled ``labels[a + k]`` (default ``tokens``).

    Returns ``(sum w*CE, sum w, [per-slot CE or None])``."""
    import torch

    t_cfg, t_params, d_cfg, _ = models
    w = d_cfg.block_size
    s = len(tokens)
    emb = np.asarray(t_params["embed"], np.float32)
    block = [int(tokens[a])] + [d_cfg.mask_token_id] * (w - 1)
    with torch.no_grad():
        hid = zref(position_ids=torch.arange(a + w)[None], noise_embedding=torch.tensor(emb[block])[None],
                   target_hidden=torch.tensor(np.asarray(feats[:a], np.float32))[None])
        lg = (hid[0] @ torch.tensor(emb).T).double().numpy()
    ce_sum = w_sum = 0.0
    slots = []
    for k in range(1, w):
        p = a + k
        if p >= s or mask[p] == 0:
            slots.append(None)
            continue
        logp = lg[k] - lg[k].max()
        logp = logp - math.log(np.exp(logp).sum())
        ce = -logp[(tokens if labels is None else labels)[p]]
        wk = math.exp(-(k - 1) / GAMMA)
        ce_sum += wk * ce
        w_sum += wk
        slots.append(ce)
    return ce_sum, w_sum, slots


def test_loss_matches_hand_written_per_block_loop(models, zref):
    tokens, mask, feats = make_batch([30, 21], 32, seed=1)
    anchors, valid = objective.sample_anchors(jax.random.key(3), jnp.asarray(mask), 8)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    assert valid.all()
    got = terms(models, tokens, mask, feats, anchors, valid)
    total_ce = total_w = 0.0
    for b in range(2):
        for j in range(anchors.shape[1]):
            ce, w, _ = reference_block(models, zref, tokens[b], mask[b], feats[b], int(anchors[b, j]))
            np.testing.assert_allclose(float(got["ce"][b, j]), ce, rtol=2e-5, atol=1e-5)
            np.testing.assert_allclose(float(got["weight"][b, j]), w, rtol=1e-6)
            total_ce, total_w = total_ce + ce, total_w + w
    t_cfg, t_params, d_cfg, d_params = models
    loss, m = jax.jit(objective.dflash_loss, static_argnames=("cfg", "target_cfg", "gamma"))(d_params, d_cfg, t_params, t_cfg, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(feats),
                                    jnp.asarray(anchors), jnp.asarray(valid), GAMMA)
    np.testing.assert_allclose(float(loss), total_ce / total_w, rtol=2e-5)
    np.testing.assert_allclose(float(m["weight_sum"]), total_w, rtol=1e-6)


def test_anchor_at_position_zero_and_near_the_end(models, zref):
    tokens, mask, feats = make_batch([20], 20, prompt=0, seed=2)
    anchors = np.array([[0, 15, 18]])
    got = terms(models, tokens, mask, feats, anchors, np.ones_like(anchors, bool))
    for j, a in enumerate(anchors[0]):
        ce, w, _ = reference_block(models, zref, tokens[0], mask[0], feats[0], int(a))
        np.testing.assert_allclose(float(got["ce"][0, j]), ce, rtol=2e-5, atol=1e-5)
        np.testing.assert_allclose(float(got["weight"][0, j]), w, rtol=1e-6)
    assert float(got["weight"][0, 2]) == pytest.approx(1.0)  # a = 18, S = 20: only slot 1 exists


def test_labels_not_off_by_one(models, zref):
    t_cfg, t_params, d_cfg, d_params = models
    w = d_cfg.block_size
    tokens, mask, feats = make_batch([32], 32, seed=3)
    a = 9
    labels, weights = objective.block_targets(jnp.asarray(tokens), jnp.asarray(mask), jnp.array([[a]]), jnp.array([[True]]), w, GAMMA)
    assert np.asarray(labels)[0, 0, 1:].tolist() == tokens[0, a + 1 : a + w].tolist()  # same position, not a + k + 1
    assert float(weights[0, 0, 0]) == 0.0  # the anchor slot is never supervised
    np.testing.assert_allclose(np.asarray(weights)[0, 0, 1:], np.exp(-np.arange(w - 1) / GAMMA), rtol=1e-6)
    # per-slot CE is -log p(token at the slot's own position)
    got = terms(models, tokens, mask, feats, [[a]], [[True]])
    _, _, slots = reference_block(models, zref, tokens[0], mask[0], feats[0], a)
    np.testing.assert_allclose(np.asarray(got["slots"])[0, 0], np.array(slots, np.float64), rtol=2e-5, atol=1e-5)
    # the token right after the block (what shifted labels would use for the last slot) is not a label
    t2 = tokens.copy()
    t2[0, a + w] = (t2[0, a + w] + 1) % 127
    assert float(terms(models, t2, mask, feats, [[a]], [[True]])["ce"][0, 0]) == float(got["ce"][0, 0])
    t3 = tokens.copy()
    t3[0, a + w - 1] = (t3[0, a + w - 1] + 1) % 127
    assert float(terms(models, t3, mask, feats, [[a]], [[True]])["ce"][0, 0]) != float(got["ce"][0, 0])


def test_given_labels_replace_the_tokens_as_targets_only(models, zref):
    """``labels`` (the target's greedy next tokens with ``labels="target"``) set what each slot
    learns; the block's anchor token still comes from ``tokens``."""
    t_cfg, t_params, d_cfg, d_params = models
    tokens, mask, feats = make_batch([30], 32, seed=4)
    labels = np.random.RandomState(5).randint(0, 127, tokens.shape).astype(np.int32)
    anchors = np.array([[4, 11, 20]])
    run = jax.jit(objective.loss_terms, static_argnames=("cfg", "target_cfg", "gamma"))
    args = (d_params, d_cfg, t_params, t_cfg, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(feats), jnp.asarray(anchors),
            jnp.ones((1, 3), bool), GAMMA, None)
    got = run(*args, jnp.asarray(labels))
    for j, a in enumerate(anchors[0]):
        ce, _, slots = reference_block(models, zref, tokens[0], mask[0], feats[0], int(a), labels=labels[0])
        np.testing.assert_allclose(float(got["ce"][0, j]), ce, rtol=2e-5, atol=1e-5)
    same = run(*args, jnp.asarray(tokens))
    assert np.array_equal(np.asarray(same["ce"]), np.asarray(terms(models, tokens, mask, feats, anchors, np.ones((1, 3), bool))["ce"]))


def test_context_excludes_the_anchor(models):
    tokens, mask, feats = make_batch([32], 32, seed=4)
    a = 12
    base = float(terms(models, tokens, mask, feats, [[a]], [[True]])["ce"][0, 0])
    rs = np.random.RandomState(9)
    for p in (a, a + 1, a + 5, 31):  # the anchor's own features and everything after it
        f2 = feats.copy()
        f2[0, p:] += 3.0 * rs.randn(*f2[0, p:].shape)
        assert float(terms(models, tokens, mask, f2, [[a]], [[True]])["ce"][0, 0]) == base, p
    f3 = feats.copy()
    f3[0, a - 1] += 3.0  # the last context position must matter
    assert abs(float(terms(models, tokens, mask, f3, [[a]], [[True]])["ce"][0, 0]) - base) > 1e-4


def test_no_block_mask_leak_between_overlapping_anchors(models):
    """B52: anchors spaced 3 apart with block size 8, so blocks overlap."""
    assert models[2].block_size == 8
    tokens, mask, feats = make_batch([40], 40, seed=5)
    anchors = np.array([[5, 8, 11, 14, 17, 20]])
    joint = terms(models, tokens, mask, feats, anchors, np.ones_like(anchors, bool))
    for j, a in enumerate(anchors[0]):
        alone = terms(models, tokens, mask, feats, [[a]], [[True]])
        np.testing.assert_allclose(np.asarray(joint["slots"][0, j]), np.asarray(alone["slots"][0, 0]), rtol=2e-6, atol=2e-6)
    # hidden states at positions a later block predicts must not reach an earlier block
    f2 = feats.copy()
    f2[0, 9:] += 5.0
    moved = terms(models, tokens, mask, f2, anchors, np.ones_like(anchors, bool))
    np.testing.assert_array_equal(np.asarray(moved["ce"][0, :2]), np.asarray(joint["ce"][0, :2]))  # anchors 5, 8 < 9
    assert (np.abs(np.asarray(moved["ce"][0, 2:]) - np.asarray(joint["ce"][0, 2:])) > 1e-5).all()


def test_padding_does_not_change_the_loss(models):
    """B52: a right-padded batch of two sequences of lengths 40 and 25."""
    tokens, mask, feats = make_batch([40, 25], 48, seed=6)
    anchors, valid = objective.sample_anchors(jax.random.key(1), jnp.asarray(mask), 12)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    batch = terms(models, tokens, mask, feats, anchors, valid)
    for b, n in enumerate([40, 25]):
        alone = terms(models, tokens[b : b + 1, :n], mask[b : b + 1, :n], feats[b : b + 1, :n], anchors[b : b + 1], valid[b : b + 1])
        np.testing.assert_allclose(np.asarray(batch["ce"][b]), np.asarray(alone["ce"][0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(batch["weight"][b]), np.asarray(alone["weight"][0]))
    # different junk in the padding: identical loss
    t2, f2 = tokens.copy(), feats.copy()
    t2[1, 25:], f2[1, 25:] = 0, 100.0
    again = terms(models, t2, mask, f2, anchors, valid)
    np.testing.assert_array_equal(np.asarray(again["ce"]), np.asarray(batch["ce"]))
    # anchors never land on padding or prompt, for many draws
    for seed in range(20):
        an, ok = objective.sample_anchors(jax.random.key(seed), jnp.asarray(mask), 12)
        an, ok = np.asarray(an), np.asarray(ok)
        for b, n in enumerate([40, 25]):
            sel = an[b][ok[b]]
            assert ((sel >= 4) & (sel < n - 1)).all()


def test_sample_anchors_distinct_sorted_and_short_sequences():
    mask = np.zeros((3, 30), np.float32)
    mask[0, 2:30] = 1
    mask[1, 10:14] = 1  # 3 valid anchors only
    mask[2, 5] = 1  # a single supervised token: no valid anchor
    an, ok = objective.sample_anchors(jax.random.key(0), jnp.asarray(mask), 8)
    an, ok = np.asarray(an), np.asarray(ok)
    assert ok[0].all() and len(set(an[0])) == 8 and (np.diff(an[0]) > 0).all()
    assert ok[1].tolist() == [True] * 3 + [False] * 5 and an[1][:3].tolist() == [10, 11, 12]
    assert not ok[2].any()


def test_bf16_compute_close_to_f32(models):
    t_cfg, t_params, d_cfg, d_params = models
    tokens, mask, feats = make_batch([30], 32, seed=7)
    args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(feats), jnp.array([[6, 12, 20]]), jnp.ones((1, 3), bool), GAMMA)
    f = jax.jit(objective.dflash_loss, static_argnames=("cfg", "target_cfg", "gamma"))
    l32, _ = f(d_params, d_cfg, t_params, t_cfg, *args)
    bf = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), d_params)
    l16, _ = f(bf, d_cfg.with_dtype("bfloat16"), t_params, t_cfg, *args)
    assert abs(float(l16) - float(l32)) < 0.05 * float(l32)


# ------------------------------------------------------------------------------ data


def greedy_dataset(t_cfg, t_params, n=12, seed=0):
    """Self-distillation in miniature: the tiny target's greedy continuations of random prompts."""
    from dflash_jax.decode import loop as decode

    rs = np.random.RandomState(seed)
    prompts = [rs.randint(0, 127, rs.randint(3, 7)).tolist() for _ in range(n)]
    st = decode.init_state(Decoding(t_cfg), prompts, 40, 24)
    st = decode.prefill(Params(t_params), st, Decoding(t_cfg), 8)
    st = decode.decode_loop(Params(t_params), st, Decoding(t_cfg))
    toks, lens = np.asarray(st.tokens), np.asarray(st.length)
    seqs = [toks[i, : lens[i]].tolist() for i in range(n)]
    masks = [[0] * len(p) + [1] * (lens[i] - len(p)) for i, p in enumerate(prompts)]
    return TokenDataset.from_sequences(seqs, masks, {"recipe": "test"})


def test_dataset_roundtrip_features_and_batches(tmp_path, models):
    t_cfg, t_params, d_cfg, _ = models
    ds = greedy_dataset(t_cfg, t_params, n=6)
    ds.save(tmp_path / "ds")
    ds2 = TokenDataset.load(tmp_path / "ds")
    assert ds2.fingerprint() == ds.fingerprint() and json.loads((tmp_path / "ds" / "meta.json").read_text())["recipe"] == "test"
    fc = cache_features(t_params, t_cfg, ds2, d_cfg.target_layer_ids, tmp_path / "feat", tokens_per_batch=64, round_to=8, progress=False)
    assert FeatureCache.load(tmp_path / "feat", ds2, d_cfg.target_layer_ids).features.shape == fc.features.shape
    with pytest.raises(ValueError):
        FeatureCache.load(tmp_path / "feat", ds2, (1,))
    b1 = Batcher(ds2, 4, 32, seed=5, features=fc)
    b2 = Batcher(ds2, 4, 32, seed=5, features=fc)
    for step in (0, 1, 7):
        x, y = b1.batch(step), b2.batch(step)
        assert all(np.array_equal(np.asarray(x[k], np.float32), np.asarray(y[k], np.float32)) for k in x)
    x = b1.batch(0)
    want = target_features(t_params, t_cfg, jnp.asarray(x["tokens"]), d_cfg.target_layer_ids)
    real = x["loss_mask"] > 0
    got = np.asarray(x["features"], np.float32)
    np.testing.assert_allclose(got[real], np.asarray(want)[real], rtol=1e-2, atol=1e-2)  # bfloat16 storage
    ids = np.concatenate([b1.sequence_ids(s) for s in range(3)])  # 12 samples = two epochs of 6
    assert sorted(ids[:6]) == sorted(ids[6:]) == list(range(6)) and b1.cursor(2) == {"sample": 8, "epoch": 1, "offset": 2}


@pytest.mark.slow
def test_grown_dataset_reuses_cached_rows(tmp_path, models, monkeypatch):
    """Rebuilding the cache for a dataset that keeps some sequences (in another order) and adds
    others copies the kept rows and computes only the new ones; every row equals a fresh cache's."""
    t_cfg, t_params, d_cfg, _ = models
    a, b = greedy_dataset(t_cfg, t_params, n=5, seed=1), greedy_dataset(t_cfg, t_params, n=3, seed=2)
    ids = d_cfg.target_layer_ids
    cache_features(t_params, t_cfg, a, ids, tmp_path / "feat", tokens_per_batch=64, round_to=8, progress=False)
    keep = [3, 0, 4]  # sequences of ``a`` kept, reordered, then all of ``b``
    rows = [a.sequence(i) for i in keep] + [b.sequence(i) for i in range(len(b))]
    grown = TokenDataset.from_sequences([t for t, _ in rows], [m for _, m in rows])
    old = np.asarray(FeatureCache.load(tmp_path / "feat", a, ids).features).copy()

    def crash(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(features_mod, "_features_jit", crash)
    with pytest.raises(KeyboardInterrupt):  # interrupted while computing the new sequences' rows
        cache_features(t_params, t_cfg, grown, ids, tmp_path / "feat", tokens_per_batch=64, round_to=8, progress=False)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "feat").iterdir()) == ["features.json", "features.npy", "index.npz"]
    np.testing.assert_array_equal(np.asarray(FeatureCache.load(tmp_path / "feat", a, ids).features), old)  # old cache intact
    fc = cache_features(t_params, t_cfg, grown, ids, tmp_path / "feat", tokens_per_batch=64, round_to=8, progress=False)
    assert fc.meta["reused_tokens"] == int(sum(a.lengths[i] for i in keep)) > 0
    for new_i, old_i in enumerate(keep):  # copied rows are the old cache's, bit for bit
        np.testing.assert_array_equal(np.asarray(fc.features[grown.offsets[new_i] : grown.offsets[new_i + 1]]),
                                      old[a.offsets[old_i] : a.offsets[old_i + 1]])
    fresh = cache_features(t_params, t_cfg, grown, ids, tmp_path / "fresh", tokens_per_batch=64, round_to=8, progress=False)
    assert fresh.meta["reused_tokens"] == 0
    np.testing.assert_allclose(np.asarray(fc.features, np.float32), np.asarray(fresh.features, np.float32), rtol=1e-2, atol=1e-2)
    assert FeatureCache.load(tmp_path / "feat", grown, ids).meta["dataset"] == grown.fingerprint()
    other = cache_features(t_params, t_cfg, grown, ids[:1], tmp_path / "feat", tokens_per_batch=64, round_to=8, progress=False)
    assert other.meta["reused_tokens"] == 0  # other layer ids: nothing to reuse


@pytest.mark.slow
def test_target_labels_are_the_targets_greedy_next_tokens(tmp_path, models):
    """``cache_features(next_tokens=True)`` stores the argmax of the target's own logits after
    every position (oracle: the target's full forward); ``Batcher(labels="target")`` labels
    position ``q`` with the next token after ``q - 1``; a cache without next tokens is refused for
    target labels and not reused when they are wanted; reused rows bring their next tokens."""
    from dflash_jax.errors import DFlashError
    from dflash_jax.families.registry import module_for

    t_cfg, t_params, d_cfg, _ = models
    rs = np.random.RandomState(3)
    seqs = [rs.randint(0, 127, n).tolist() for n in (9, 14, 5, 11)]
    ds = TokenDataset.from_sequences(seqs, [[0] * 3 + [1] * (len(x) - 3) for x in seqs])
    ids, kw = d_cfg.target_layer_ids, dict(tokens_per_batch=32, round_to=8, progress=False)
    plain = cache_features(t_params, t_cfg, ds, ids, tmp_path / "f", **kw)
    assert plain.next_tokens is None and Batcher(ds, 2, 16, features=plain).batch(0).get("labels") is None
    with pytest.raises(DFlashError, match="next tokens"):
        Batcher(ds, 2, 16, features=plain, labels="target")
    with pytest.raises(DFlashError, match="labels"):
        Batcher(ds, 2, 16, features=plain, labels="teacher")
    from dflash_jax.nn.params import unstack_layers

    per = unstack_layers(t_params)  # load_target's layout on CPU: same target, same fingerprint
    assert data_mod.target_fingerprint(t_cfg, per) == plain.meta["target"]
    fc = cache_features(t_params, t_cfg, ds, ids, tmp_path / "f", next_tokens=True, **kw)
    assert fc.meta["reused_tokens"] == 0 and fc.meta["next_tokens"]  # the old cache had no next tokens
    mod = module_for(t_cfg)
    for i, x in enumerate(seqs):
        n = len(x)
        logits, _, _ = mod.forward(t_params, t_cfg, jnp.asarray([x], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None],
                                   mod.init_cache(t_cfg, 1, n))
        assert np.asarray(fc.next_tokens[ds.offsets[i] : ds.offsets[i + 1]]).tolist() == np.argmax(np.asarray(logits[0]), -1).tolist()
    np.testing.assert_allclose(np.asarray(fc.features, np.float32), np.asarray(plain.features, np.float32), rtol=1e-2, atol=1e-2)
    b = Batcher(ds, 4, 12, seed=1, features=fc, labels="target")  # 12 < 14: one sequence truncated
    x, flat = b.batch(0), b.flat_labels()
    for r, j in enumerate(b.sequence_ids(0)):
        a, n = int(ds.offsets[j]), int(x["lengths"][r])
        assert x["labels"][r, 0] == x["tokens"][r, 0] and x["labels"][r, 1:n].tolist() == fc.next_tokens[a : a + n - 1].tolist()
        assert flat[a : a + n].tolist() == x["labels"][r, :n].tolist()
    grown = TokenDataset.from_sequences(seqs[::-1] + [rs.randint(0, 127, 7).tolist()], [[1] * len(q) for q in seqs[::-1]] + [[1] * 7])
    g = cache_features(t_params, t_cfg, grown, ids, tmp_path / "f", next_tokens=True, **kw)
    assert g.meta["reused_tokens"] == len(ds.tokens)
    fresh = cache_features(t_params, t_cfg, grown, ids, tmp_path / "fresh", next_tokens=True, **kw)
    assert np.array_equal(np.asarray(g.next_tokens), np.asarray(fresh.next_tokens))


# ------------------------------------------------------------------------------ trainer


@pytest.mark.parametrize("samples", [None, 7, 100, 4096])
def test_fingerprint_is_the_same_for_both_layer_layouts(models, samples):
    """Per-layer parameters hash as their stacked leaves (sampled values that straddle layers
    included), without building the stacked copy; a changed value in one layer changes it."""
    from dflash_jax.nn.params import unstack_layers
    from dflash_jax.nn.params import PerLayer

    t_cfg, t_params, _, d_params = models
    for tree in (t_params, d_params):
        per = unstack_layers(tree)
        assert data_mod.tree_fingerprint(per, b"x", samples) == data_mod.tree_fingerprint(tree, b"x", samples)
    per = unstack_layers(t_params)
    last = dict(per["layers"][-1], wq=per["layers"][-1]["wq"].at[-1, -1].add(1.0))
    changed = dict(per, layers=PerLayer((*per["layers"][:-1], last)))
    assert data_mod.tree_fingerprint(changed) != data_mod.tree_fingerprint(t_params)


def test_schedule_warmup_and_decay():
    tc = TrainConfig(steps=100, lr=1e-3, warmup_ratio=0.1, decay="cosine")
    s = lr_schedule(tc)
    assert float(s(0)) == 0.0 and float(s(10)) == pytest.approx(1e-3) and float(s(100)) == pytest.approx(0.0, abs=1e-9)
    assert float(s(5)) == pytest.approx(5e-4) and float(s(55)) == pytest.approx(5e-4, rel=1e-3)
    lin = lr_schedule(TrainConfig(steps=100, lr=1e-3, warmup_ratio=0.0, decay="linear", final_lr_ratio=0.1))
    assert float(lin(0)) == pytest.approx(1e-3) and float(lin(100)) == pytest.approx(1e-4)



@pytest.mark.parametrize("kwargs, option", [
    (dict(lr=-1.0), "--lr"), (dict(lr=0.0), "--lr"), (dict(lr=float("nan")), "--lr"), (dict(gamma=float("inf")), "--gamma"),
    (dict(draft_vocab=-3), "--draft-vocab"), (dict(weight_decay=-0.1), "--weight-decay"),
    (dict(grad_clip=-1.0), "--grad-clip"), (dict(final_lr_ratio=1.5), "--final-lr-ratio"), (dict(steps=0), "--steps"),
])
def test_train_config_refuses_bad_settings(kwargs, option):
    """Bad settings fail when the run is configured, before features are computed: the error names
    the argument and its option (``"lr (--lr)"``), and the command line's form names the option."""
    from dflash_jax.errors import DFlashError, option_error

    with pytest.raises(DFlashError) as e:
        TrainConfig(**kwargs)
    assert e.value.where == f"{next(iter(kwargs))} ({option})"
    assert option_error(e.value).where == option


@pytest.mark.parametrize("layers, ids, block, option", [
    (0, (), 8, "--layers"), (-1, (), 8, "--layers"), (2, (), 1, "--block-size"),
    (2, (1, 1), 8, "--target-layer-ids"), (40, (), 8, "--layers"),  # 40 taps spread over 4 layers repeat
])
def test_drafter_config_for_refuses_bad_shapes(layers, ids, block, option):
    from dflash_jax.errors import DFlashError
    from dflash_jax.cli.train import drafter_config_for

    t_cfg, _ = tiny_target("llama", seed=0)
    with pytest.raises(DFlashError) as e:
        drafter_config_for(t_cfg, layers, ids, 3, block)
    assert e.value.where == option
    assert drafter_config_for(t_cfg, 2, (0, 2), 3, 2).target_layer_ids == (0, 2)  # the smallest valid block

TC = TrainConfig(steps=40, batch_size=6, max_len=32, num_anchors=8, lr=1e-2, warmup_ratio=0.05, seed=3)


@pytest.fixture(scope="module")
def tiny_run(models):
    t_cfg, t_params, _, _ = models
    d_cfg, _ = tiny_drafter(t_cfg, layer_ids=(0, 2), block_size=4)
    ds = greedy_dataset(t_cfg, t_params, n=12)
    return t_cfg, t_params, d_cfg, ds


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_run):
    """An uninterrupted 40-step run with tau measured at the start and the end."""
    t_cfg, t_params, d_cfg, ds = tiny_run
    out = tmp_path_factory.mktemp("full")
    losses = []
    prompts = [ds.sequence(i)[0][:4].tolist() for i in range(3)]
    state, summary = train(out, target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=Batcher(ds, TC.batch_size, TC.max_len, seed=TC.seed), tc=TC,
                           eval_prompts=prompts, eval_max_new=16, ckpt_every=1000, progress=False, on_step=lambda s, m: losses.append(m["loss"]))
    return out, state, summary, losses


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path, tiny_run, full_run):
    t_cfg, t_params, d_cfg, ds = tiny_run
    _, full, s_full, _ = full_run
    assert s_full["finished"] and s_full["step"] == TC.steps
    batcher = Batcher(ds, TC.batch_size, TC.max_len, seed=TC.seed)
    part, s_part = train(tmp_path / "b", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=batcher, tc=TC,
                         ckpt_every=5, stop_at=17, progress=False)
    assert not s_part["finished"] and latest_checkpoint(tmp_path / "b" / "checkpoints").name == "step_00000017"
    resumed, s_res = train(tmp_path / "b", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=Batcher(ds, TC.batch_size, TC.max_len, seed=TC.seed), tc=TC,
                           ckpt_every=5, progress=False)
    assert s_res["finished"] and s_res["tokens_seen"] == s_full["tokens_seen"]
    for x, y in zip(jax.tree_util.tree_leaves((full.params, full.opt_state)), jax.tree_util.tree_leaves((resumed.params, resumed.opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    log = [json.loads(l) for l in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, TC.steps + 1))
    with pytest.raises(ValueError, match="settings differ"):
        train(tmp_path / "b", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=batcher, tc=dataclasses.replace(TC, lr=1e-3),
              progress=False)


@pytest.mark.slow
def test_training_reduces_the_loss_and_raises_tau(full_run):
    out, _, _, losses = full_run
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    curve = json.loads((out / "tau_curve.json").read_text())
    assert [r["step"] for r in curve] == [0, TC.steps] and curve[-1]["tau"] > curve[0]["tau"]


@pytest.mark.slow
def test_continue_from_trained_weights(tmp_path, tiny_run, full_run):
    """``init_params`` starts a run from a trained drafter: its step-0 tau is the trained
    drafter's final tau, the weights are part of the run's signature, wrong shapes are refused."""
    t_cfg, t_params, d_cfg, ds = tiny_run
    out, full, _, _ = full_run
    prompts = [ds.sequence(i)[0][:4].tolist() for i in range(3)]
    tc = dataclasses.replace(TC, steps=3)
    batcher = Batcher(ds, tc.batch_size, tc.max_len, seed=tc.seed)
    _, s = train(tmp_path / "c", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=batcher, tc=tc,
                 eval_prompts=prompts, eval_max_new=16, progress=False, init_params=full.params)
    curve = json.loads((tmp_path / "c" / "tau_curve.json").read_text())
    assert s["finished"] and curve[0]["tau"] == json.loads((out / "tau_curve.json").read_text())[-1]["tau"]
    assert json.loads((tmp_path / "c" / "run.json").read_text())["signature"]["init"] == params_fingerprint(full.params)
    with pytest.raises(ValueError, match=r"settings differ from the checkpointed run.s \(init\)"):
        train(tmp_path / "c", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=batcher, tc=tc, progress=False)
    from dflash_jax.nn.params import unstack_layers

    # the same weights per layer (load_drafter's CPU layout): the same run, found finished
    _, again = train(tmp_path / "c", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=batcher, tc=tc,
                     progress=False, init_params=unstack_layers(full.params))
    assert again["finished"]
    bad = dict(full.params, fc=full.params["fc"][:, :-1])
    with pytest.raises(ValueError, match=r"\['fc'\] is"):
        train(tmp_path / "d", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=batcher, tc=tc, progress=False, init_params=bad)


# ------------------------------------------------------------------------------ export


@pytest.mark.parametrize("variant", ["plain", "sliding"])
def test_export_config_roundtrip(variant, models):
    from dflash_jax.drafter.model import drafter_config_from_hf

    t_cfg = models[0]
    over = {} if variant == "plain" else dict(layer_causal=(True, False), layer_window=(5, 0))
    d_cfg, _ = tiny_drafter(t_cfg, **over)
    assert drafter_config_from_hf(json.loads(json.dumps(drafter_hf_config(d_cfg)))) == d_cfg


def test_export_loads_in_our_loader_and_the_zlab_reference(tmp_path, models):
    torch = pytest.importorskip("torch")
    zlab = pytest.importorskip("dflash.model")
    from dflash_jax.drafter.model import load_hf_drafter as load_drafter
    from dflash_jax.families.registry import module_for

    t_cfg, t_params, d_cfg, d_params = models
    f32 = export_drafter(tmp_path / "f32", d_cfg, d_params, dtype="float32", extra={"dflash_jax": {"note": "test"}})
    cfg2, p2 = load_drafter(f32, t_cfg)
    assert cfg2 == d_cfg
    for x, y in zip(jax.tree_util.tree_leaves(d_params), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bf = export_drafter(tmp_path / "bf16", d_cfg, d_params)
    _, p3 = load_drafter(bf, t_cfg)
    for x, y in zip(jax.tree_util.tree_leaves(d_params), jax.tree_util.tree_leaves(p3)):
        np.testing.assert_array_equal(np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(y))

    ref = zlab.DFlashDraftModel.from_pretrained(str(f32)).eval().float()
    assert ref.block_size == d_cfg.block_size and ref.mask_token_id == d_cfg.mask_token_id
    assert list(ref.target_layer_ids) == list(d_cfg.target_layer_ids)
    ctx, w = 9, d_cfg.block_size
    rs = np.random.RandomState(0)
    feats = rs.randn(1, ctx, 2 * t_cfg.hidden_size).astype(np.float32)
    block = np.array([[7] + [d_cfg.mask_token_id] * (w - 1)])
    emb = np.asarray(t_params["embed"])
    with torch.no_grad():
        hid = ref(position_ids=torch.arange(ctx + w)[None], noise_embedding=torch.tensor(emb[block]), target_hidden=torch.tensor(feats))
        want = (hid @ torch.tensor(emb).T).numpy()
    k, v = drafter.context_kv(d_params, d_cfg, jnp.asarray(feats), jnp.arange(ctx, dtype=jnp.int32)[None])
    out = drafter.forward(d_params, d_cfg, module_for(t_cfg), t_params, t_cfg, jnp.asarray(block), ctx + jnp.arange(w, dtype=jnp.int32)[None], k, v, jnp.array([ctx]))
    got = np.asarray(drafter.logits(d_params, d_cfg, module_for(t_cfg), t_params, t_cfg, out))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.slow
def test_cli_trains_resumes_and_exports(tmp_path, capsys):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_hf import make_tiny_hf

    from dflash_jax.drafter.model import load_hf_drafter as load_drafter
    from dflash_jax.families.dense.safetensors import load_hf_target
    from dflash_jax.cli.train import main

    target = make_tiny_hf(tmp_path / "target")
    rs = np.random.RandomState(0)
    seqs = [rs.randint(0, 256, rs.randint(12, 30)).tolist() for _ in range(6)]
    ds = TokenDataset.from_sequences(seqs, [[0] * 4 + [1] * (len(s) - 4) for s in seqs])
    ds.save(tmp_path / "data")
    (tmp_path / "eval.json").write_text(json.dumps({"ids": [seqs[0][:6]]}))
    argv = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--target", str(target), "--mask-token-id", "258",
            "--layers", "1", "--target-layer-ids", "0,1", "--block-size", "4", "--steps", "4", "--batch-size", "2",
            "--max-len", "32", "--num-anchors", "4", "--ckpt-every", "2", "--no-progress", "--draft-vocab", "48",
            "--eval-prompts", str(tmp_path / "eval.json"), "--eval-max-new", "6"]
    assert main(argv + ["--stop-at", "2"]) == 0
    assert not (tmp_path / "run" / "drafter").exists()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "step 4/4 (finished)" in err and "exported" in err
    t_cfg, _ = load_hf_target(target)
    cfg, _ = load_drafter(tmp_path / "run" / "drafter", t_cfg)
    assert cfg.target_layer_ids == (0, 1) and cfg.mask_token_id == 258 and cfg.block_size == 4
    recorded = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())["dflash_jax"]
    assert recorded["steps"] == 4 and recorded["draft_vocab"]["size"] == 48
    ids = draft_vocab.load(tmp_path / "run" / "drafter", t_cfg.vocab_size)
    np.testing.assert_array_equal(ids, draft_vocab.most_frequent(ds.tokens, ds.loss_mask, 48, t_cfg.vocab_size))
    assert recorded["draft_vocab"]["response_coverage"] == round(draft_vocab.coverage(ids, ds.tokens, ds.loss_mask), 5) < 1.0
    tau = json.loads((tmp_path / "run" / "tau_curve.json").read_text())
    assert [r["step"] for r in tau] == [0, 4] and all(r["verify_steps"] > 0 for r in tau)  # evaluated over the draft vocabulary
    assert (tmp_path / "run" / "drafter" / "training_curve.csv").read_text().startswith("step,tokens_seen")
    bad = [("999" if a == "258" else a) for a in argv]
    assert main(bad) == 2  # outside the vocabulary: one-line error
    assert "mask_token_id" in capsys.readouterr().err
    # continue the exported drafter in a new run: it starts where the first run ended
    more = [("run2" if a == str(tmp_path / "run") else a) for a in argv]
    more[more.index("run2")] = str(tmp_path / "run2")
    assert main(more + ["--init-from", str(tmp_path / "run" / "drafter"), "--steps", "2"]) == 0
    tau2 = json.loads((tmp_path / "run2" / "tau_curve.json").read_text())
    assert tau2[0]["tau"] == pytest.approx(tau[-1]["tau"], abs=0.15)  # bfloat16 export of the same weights
    assert json.loads((tmp_path / "run2" / "drafter" / "config.json").read_text())["dflash_jax"]["init_from"]["steps"] == 4
    curve = [dict(r) for r in csv.DictReader(open(tmp_path / "run2" / "drafter" / "training_curve.csv"))]
    first = list(csv.DictReader(open(tmp_path / "run" / "drafter" / "training_curve.csv")))
    assert [(r["step"], r["run"]) for r in curve] == [("0", "1"), ("4", "1"), ("6", "2")]  # one curve over both runs
    assert int(curve[-1]["tokens_seen"]) == int(first[-1]["tokens_seen"]) + json.loads((tmp_path / "run2" / "tau_curve.json").read_text())[-1]["tokens_seen"]
    capsys.readouterr()
    assert main(more + ["--init-from", str(tmp_path / "run" / "drafter"), "--steps", "2"]) == 0  # a finished run reruns as a no-op
    capsys.readouterr()
    assert main(more + ["--init-from", str(tmp_path / "run" / "drafter"), "--target-layer-ids", "1,0", "--out", str(tmp_path / "r3")]) == 2
    assert "--target-layer-ids: 1,0 (expected 0,1, as in" in capsys.readouterr().err
    assert main(more + ["--init-from", str(tmp_path / "run" / "drafter"), "--export", str(tmp_path / "run" / "drafter")]) == 2
    assert "--export:" in capsys.readouterr().err
    assert main(argv + ["--labels", "target", "--no-feature-cache"]) == 2
    assert "--labels: 'target' without a feature cache" in capsys.readouterr().err
    assert main(argv + ["--warmup-ratio", "1.5"]) == 2
    assert "error: --warmup-ratio: got 1.5 (expected a fraction in [0, 1))" in capsys.readouterr().err
    # target labels: the cache is rebuilt with the target's next tokens, and the checkpointed run
    # (trained on the data's tokens) is not resumed with other labels
    assert main(more + ["--init-from", str(tmp_path / "run" / "drafter"), "--steps", "2", "--labels", "target"]) == 2
    assert "differ from the checkpointed run's (labels)" in capsys.readouterr().err
    assert FeatureCache.load(tmp_path / "run2" / "features", ds).next_tokens is not None


def test_module_entry_point_is_the_train_cli():
    """``python -m dflash_jax.train`` runs ``dflash-jax train`` (same parser, same exit codes)."""
    import subprocess

    ok = subprocess.run([sys.executable, "-m", "dflash_jax.train", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: dflash-jax train")
    bad = subprocess.run([sys.executable, "-m", "dflash_jax.train", "--out", "x", "--mask-token-id", "16"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: ") and "--data" in bad.stderr


def test_plot_training_curve_tool(tmp_path):
    """``tools/plot_training_curve.py`` (run as a program): a PNG from a training_curve.csv; a missing or
    foreign file is a usage error naming it."""
    repo = Path(__file__).resolve().parents[1]

    def ptc(*argv):
        return subprocess.run([sys.executable, "tools/plot_training_curve.py", *map(str, argv)], cwd=repo,
                              capture_output=True, text=True, timeout=300)

    src = tmp_path / "training_curve.csv"
    src.write_text("step,supervised_seen,tau,run\n0,0,1.0,1\n10,5000,1.2,1\n20,9000,1.3,2\n")
    assert ptc(src, tmp_path / "c.png").returncode == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    for bad, needle in ((tmp_path / "nope.csv", "cannot read"), (tmp_path / "other.csv", "no rows or no column")):
        r = ptc(bad, tmp_path / "d.png")
        assert r.returncode == 2 and f"{bad}: {needle}" in r.stderr
    assert not (tmp_path / "d.png").exists()


def _plain_trees(tree):
    """``tree`` as the trainer held it while its params were plain dicts: every ``nnx.State`` (the
    drafter module's params, the AdamW moments) a nested dict of its values."""
    from flax import nnx

    is_state = lambda x: isinstance(x, nnx.State)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: nnx.to_pure_dict(x) if is_state(x) else x, tree, is_leaf=is_state)


def test_checkpoints_roundtrip_and_an_older_safetensors_checkpoint_still_resumes(tmp_path):
    """A checkpoint of the earlier writer (safetensors + state.json) is found and restored exactly;
    the orbax checkpoint written after it restores the same state bit for bit (step, PRNG key,
    cursor) and, with ``keep=1``, replaces it."""
    from safetensors.numpy import load_file

    from dflash_jax.formats.files import write_safetensors
    from dflash_jax.testing import tiny_drafter_config, tiny_target_config
    from dflash_jax.train.checkpoint import load_checkpoint, save_checkpoint
    from dflash_jax.train.step import TrainState, init_train_state

    d_cfg = tiny_drafter_config(tiny_target_config(), layer_ids=(0, 2), block_size=4)
    template = init_train_state(d_cfg, TC)
    bump = lambda tree, k: jax.tree_util.tree_map(lambda x: np.asarray(x) + k, tree)
    flat = lambda tree: {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(v)  # the old writer's names: plain trees'
                         for p, v in jax.tree_util.tree_flatten_with_path(_plain_trees(tree))[0]}
    old = tmp_path / "checkpoints" / "step_00000007"
    old.mkdir(parents=True)
    write_safetensors(old / "params.safetensors", flat(bump(template.params, 1)))
    write_safetensors(old / "opt_state.safetensors", flat(bump(template.opt_state, 2)))
    assert "layers.wq" in load_file(str(old / "params.safetensors"))
    key = jax.random.key(11)
    (old / "state.json").write_text(json.dumps({"step": 7, "rng": np.asarray(jax.random.key_data(key)).tolist(),
                                                "rng_impl": str(jax.random.key_impl(key)), "cursor": {"sample": 42}}))
    assert latest_checkpoint(tmp_path / "checkpoints") == old
    st, meta = load_checkpoint(old, template)
    assert int(st.step) == 7 and meta["cursor"] == {"sample": 42}
    np.testing.assert_array_equal(jax.random.key_data(st.rng), jax.random.key_data(key))
    for x, y in zip(jax.tree_util.tree_leaves((st.params, st.opt_state)),
                    jax.tree_util.tree_leaves((bump(template.params, 1), bump(template.opt_state, 2)))):
        np.testing.assert_array_equal(np.asarray(x), y)
    st = TrainState(params=st.params, opt_state=st.opt_state, rng=jax.random.split(st.rng)[0], step=st.step + 1)
    new = save_checkpoint(tmp_path / "checkpoints", st, {"cursor": {"sample": 48}}, keep=1)
    assert new.name == "step_00000008" and latest_checkpoint(tmp_path / "checkpoints") == new and not old.exists()
    back, meta = load_checkpoint(new, template)
    assert int(back.step) == 8 and meta["cursor"] == {"sample": 48} and meta["step"] == 8
    np.testing.assert_array_equal(jax.random.key_data(back.rng), jax.random.key_data(st.rng))
    for x, y in zip(jax.tree_util.tree_leaves((back.params, back.opt_state)), jax.tree_util.tree_leaves((st.params, st.opt_state))):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _orbax_layout(path) -> dict:
    """The array tree of a checkpoint's ``state`` item as orbax describes it on disk (each
    array's key path, with key types, and value type and shape)."""
    return json.loads((Path(path) / "state" / "_METADATA").read_text())["tree_metadata"]


def test_an_orbax_checkpoint_of_the_plain_dict_trainer_restores_into_the_module_state(tmp_path):
    """A checkpoint written as the trainer wrote it while its params were plain dicts (the same
    orbax call over dict trees) restores into a template whose params are the drafter module's
    ``nnx.State``: the same values, the template's param metadata; and a checkpoint written now
    holds the same array names (``params.layers.wq``, no ``.value``), so either restores in the other."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from dflash_jax.nn.module import tree_of
    from dflash_jax.testing import tiny_drafter_config, tiny_target_config
    from dflash_jax.train.checkpoint import load_checkpoint, save_checkpoint
    from dflash_jax.train.step import init_train_state, make_optimizer

    d_cfg = tiny_drafter_config(tiny_target_config(), layer_ids=(0, 2), block_size=4)
    template = init_train_state(d_cfg, TC)
    params = jax.tree_util.tree_map(lambda x: x + 1.0, tree_of(template.params))
    assert isinstance(params, dict) and isinstance(template.params, nnx.State)
    opt = jax.tree_util.tree_map(lambda x: x + 2, make_optimizer(TC).init(params))  # the moments as dicts
    key = jax.random.key(5)
    old = tmp_path / "old" / "step_00000005"
    ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(old.absolute(), args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt, "rng": jax.random.key_data(key)}),
        meta=ocp.args.JsonSave({"step": 5, "rng_impl": str(jax.random.key_impl(key)), "cursor": {"sample": 3}})))
    st, meta = load_checkpoint(old, template)
    assert int(st.step) == 5 and meta["cursor"] == {"sample": 3}
    assert isinstance(st.params, nnx.State) and isinstance(st.opt_state[1][0].mu, nnx.State)
    assert jax.tree_util.tree_structure(st.params) == jax.tree_util.tree_structure(template.params)  # metadata included
    assert st.params["layers"]["wq"].get_metadata()["out_sharding"] == ("layers", "embed", "q_heads")
    np.testing.assert_array_equal(jax.random.key_data(st.rng), jax.random.key_data(key))
    for x, y in zip(jax.tree_util.tree_leaves((st.params, st.opt_state)), jax.tree_util.tree_leaves((params, opt))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    new = save_checkpoint(tmp_path / "new", st, {"cursor": {"sample": 3}})
    assert _orbax_layout(new) == _orbax_layout(old) and "('params', 'layers', 'wq')" in _orbax_layout(new)
    back, _ = load_checkpoint(new, template)
    for x, y in zip(jax.tree_util.tree_leaves((back.params, back.opt_state)), jax.tree_util.tree_leaves((params, opt))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_checkpoint_restores_into_a_drafter_module_that_then_generates(tmp_path, models):
    """The documented way back from training to a drafter: ``set_weights(drafter.model,
    state.params)`` with a restored checkpoint's state (float32, layers stacked) into a drafter
    held per layer, as ``load_drafter`` holds one on the CPU. The module's params are then the
    checkpoint's, ``drafter.state()`` is what runs, and ``dj.generate`` drafts as a drafter
    loaded with those weights does (the same tokens, the target's greedy ones, and the same
    acceptance)."""
    import dflash_jax as dj
    from dflash_jax.loading import Drafter, Target
    from dflash_jax.nn.module import set_weights, tree_of
    from dflash_jax.nn.params import unstack_layers
    from dflash_jax.testing import reference_greedy
    from dflash_jax.train.checkpoint import load_checkpoint, save_checkpoint
    from dflash_jax.train.step import drafter_module, init_train_state

    t_cfg, t_params, d_cfg, d_params = models
    trained = init_train_state(d_cfg, TC, init_params=d_params)  # stands for a trained drafter's state
    path = save_checkpoint(tmp_path / "checkpoints", trained, {})
    state, _ = load_checkpoint(path, init_train_state(d_cfg, TC))
    target = Target(cfg=t_cfg, params=t_params)
    loaded = Drafter(cfg=d_cfg, params=unstack_layers(drafter.init_params(d_cfg, jax.random.key(9), scale=0.2)))  # other weights
    assert not np.array_equal(np.asarray(loaded.model.fc.get_value()), np.asarray(d_params["fc"]))
    set_weights(loaded.model, state.params)
    held = tree_of(loaded.state())
    assert jax.tree_util.tree_structure(held) == jax.tree_util.tree_structure(unstack_layers(d_params))
    for x, y in zip(jax.tree_util.tree_leaves(held), jax.tree_util.tree_leaves(unstack_layers(tree_of(state.params)))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree_util.tree_leaves(held), jax.tree_util.tree_leaves(unstack_layers(d_params))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    prompt = [5, 9, 17, 3]
    got = dj.generate(target, [prompt], max_new_tokens=12, drafter=loaded, n_max=3)
    want = dj.generate(target, [prompt], max_new_tokens=12, drafter=Drafter(cfg=d_cfg, params=d_params), n_max=3)
    assert got.output_ids == want.output_ids == [reference_greedy(t_params, t_cfg, prompt, 12)]
    for k in ("verify_steps", "accepted_per_position", "accepted_tokens"):
        assert got.stats[k] == want.stats[k], k
    module = drafter_module(d_cfg, state.params)  # the module of a training state, over its arrays
    assert type(module) is type(loaded.model) and module.fc.get_value() is state.params["fc"].get_value()
