"""The drafter shipped for the default target: it loads in our loader and in the z-lab reference,
its recorded settings hold, and speculative decoding with it is lossless and accepts drafts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax import loading
from dflash_jax.runtime.fingerprint import weights_fingerprint
from dflash_jax.families.dense.gguf_cache import cache_path
from dflash_jax.nn.params import PerLayer

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Explain what a hash table is in two sentences.",
]


@pytest.fixture(scope="module")
def pair():
    target = dj.load_target()
    folder = loading.shipped_drafter_path(target)
    assert folder is not None, "no drafter ships for the default target"
    return target, folder, dj.shipped_drafter(target)


def test_recorded_settings(pair):
    target, folder, drafter = pair
    config = json.loads((folder / "config.json").read_text())
    recorded = config["dflash_jax"]
    assert drafter.cfg.block_size == config["dflash_config"]["block_size"]
    assert drafter.n_max == recorded["n_max"] == "auto"  # adaptive depth, with its calibration
    assert (drafter.auto_depth, drafter.tree) == (recorded["auto_depth"], recorded["tree"]) == (3, 3)  # over a tree of 3 nodes
    assert drafter.calibration.scale == tuple(recorded["depth_calibration"]["scale"])
    assert len(drafter.calibration.bias) == drafter.cfg.block_size - 1
    ids = draft_vocab.load(folder, target.cfg.vocab_size)
    assert ids is not None and drafter.cfg.draft_vocab_size == len(ids) == recorded["draft_vocab"]["size"]
    np.testing.assert_array_equal(np.asarray(drafter.params["draft_head"]), np.asarray(target.params["lm_head"])[:, ids])
    assert target.tokenizer.decode([drafter.cfg.mask_token_id]) == recorded["mask_token"]
    assert drafter.cfg.mask_token_id not in ids.tolist()  # never a draft
    assert target.fingerprint == recorded["target_fingerprint"]  # recorded by the float32 cache
    assert weights_fingerprint(target.cfg, target.params) == recorded["target_fingerprint"]  # per-layer, on the device


def test_a_renamed_copy_finds_the_drafter(pair, tmp_path):
    """A copy of the default GGUF under another name (converted afresh: no cache beside it) gets
    the shipped drafter by the fingerprint of its weights."""
    target, folder, _ = pair
    copy = tmp_path / "my-model.gguf"
    shutil.copyfile(target.source, copy)
    try:
        renamed = dj.load_target(copy)
        assert renamed.fingerprint == target.fingerprint
        assert loading.shipped_drafter_path(renamed) == folder
    finally:
        shutil.rmtree(cache_path(copy), ignore_errors=True)  # 513 MiB


def test_loads_in_the_zlab_reference(pair):
    zlab = pytest.importorskip("dflash.model")
    target, folder, drafter = pair
    ref = zlab.DFlashDraftModel.from_pretrained(str(folder))
    assert ref.block_size == drafter.cfg.block_size and ref.mask_token_id == drafter.cfg.mask_token_id
    assert list(ref.target_layer_ids) == list(drafter.cfg.target_layer_ids)
    w = ref.state_dict()["fc.weight"].float().numpy()  # [out, in]
    np.testing.assert_array_equal(w.T, np.asarray(drafter.params["fc"]))


def test_lossless_and_accepts_drafts(pair, tmp_path, monkeypatch):
    """The default (``n_max="auto"``, its costs measured for this machine) and a fixed depth."""
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))  # the measured costs: not the user's folder
    target, _, drafter = pair
    for text in PROMPTS:
        ids = dj.encode_prompt(target, text)
        plain = dj.generate(target, [ids], max_new_tokens=48)
        for n_max in (None, 3):
            spec = dj.generate(target, [ids], max_new_tokens=48, drafter=drafter, n_max=n_max)
            assert spec.output_ids == plain.output_ids and spec.stats["n_max"] == (n_max or "auto")
            assert spec.stats["tree"] == (None if n_max else 3)  # the recorded tree goes with the recorded depth
            assert spec.stats["accepted_tokens"] > 0, f"no draft accepted for {text!r} at n_max {n_max}"


def test_layer_layouts_agree(pair):
    """``load_drafter`` keeps per-layer buffers on CPU ("auto"); the stacked layout (GPU, meshes,
    training) drafts the same tokens with the same acceptance."""
    target, folder, drafter = pair
    assert isinstance(drafter.params["layers"], PerLayer)
    stacked = dj.load_drafter(folder, target, layers="stacked")
    assert isinstance(stacked.params["layers"], dict)
    ids = dj.encode_prompt(target, PROMPTS[0])
    a, b = (dj.generate(target, [ids], max_new_tokens=32, drafter=d, n_max=3) for d in (drafter, stacked))
    assert a.output_ids == b.output_ids
    keys = ("tau", "verify_steps", "accepted_per_position", "drafted_tokens", "accepted_tokens")
    assert [a.stats[k] for k in keys] == [b.stats[k] for k in keys]
    with pytest.raises(dj.DFlashError, match="layers"):
        dj.load_drafter(folder, target, layers="scan")
