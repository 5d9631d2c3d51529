"""The fingerprint of a target's weights, and the shipped drafter found by it: by the target's
content, not its file name (a renamed or re-saved copy finds it; other weights under the same
name do not)."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import numpy as np
from tiny_gguf import Q, model_kv, model_tensors, tiny_cfg, tokens_for, write_gguf, write_model

import dflash_jax as dj
from dflash_jax.assets import default_model as assets
from dflash_jax import loading
from dflash_jax.runtime.fingerprint import weights_fingerprint
from dflash_jax.families.dense import model as dense
from dflash_jax.nn.params import unstack_layers


def _params(cfg, seed):
    return jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(seed)))


def test_fingerprint_ignores_layout_and_the_derived_head_and_sees_every_weight():
    cfg = tiny_cfg("llama", tie=True)
    p = _params(cfg, 0)
    fp = weights_fingerprint(cfg, p)
    assert fp.startswith("f32-sha256:") and len(fp) == len("f32-sha256:") + 64
    assert weights_fingerprint(cfg, unstack_layers(p)) == fp  # per-layer layout
    on_device = loading.with_output_head(jax.device_put(p))  # JAX leaves, with the [H, V] copy of the tied embedding
    assert "lm_head" in on_device and weights_fingerprint(cfg, on_device) == fp
    changed = jax.tree_util.tree_map(np.copy, p)
    changed["layers"]["wo"][1, 0, 0] += 1e-3
    assert weights_fingerprint(cfg, changed) != fp
    swapped = dict(p, layers={k: v[::-1] for k, v in p["layers"].items()})  # the same bytes in another order
    assert weights_fingerprint(cfg, swapped) != fp


def test_shipped_drafter_is_found_by_content_not_by_name(tmp_path, monkeypatch):
    cfg = tiny_cfg("llama")
    a, b = _params(cfg, 1), _params(cfg, 2)
    folder = tmp_path / "drafter"
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    monkeypatch.setattr(assets, "shipped_drafters", lambda: (assets.ShippedDrafter(folder, weights_fingerprint(cfg, a), shape),))

    def found(path):
        return loading.shipped_drafter_path(dj.load_target(path))

    (tmp_path / "one").mkdir()
    original = write_model(tmp_path / "one" / "model.gguf", cfg, a)
    target = dj.load_target(original)
    assert target.fingerprint == weights_fingerprint(cfg, a)  # recorded in the float32 cache, not recomputed
    assert loading.shipped_drafter_path(target) == folder
    assert loading.shipped_drafter_path(dataclasses.replace(target, fingerprint=None)) == folder  # computed from the weights
    shutil.copy(original, tmp_path / "renamed.gguf")
    assert found(tmp_path / "renamed.gguf") == folder
    kv = dict(model_kv(cfg), **{"general.name": "a re-saved copy", "general.description": "other metadata"})
    resaved = write_gguf(tmp_path / "resaved.gguf", cfg.family, kv, model_tensors(cfg, a), tokens_for(cfg))
    assert found(resaved) == folder
    (tmp_path / "two").mkdir()
    assert found(write_model(tmp_path / "two" / "model.gguf", cfg, b)) is None  # same name and shapes, other weights
    assert found(write_model(tmp_path / "q8.gguf", cfg, a, qtype=Q.Q8_0)) is None  # re-quantized: other weights


def test_the_shipped_drafter_records_its_target(tmp_path):
    (shipped,) = assets.shipped_drafters()
    assert shipped.folder.name == "smollm2-135m-instruct" and shipped.target_shape == (30, 576, 49152)
    assert shipped.target_fingerprint.startswith("f32-sha256:")
    cfg = tiny_cfg("llama")
    impostor = write_model(tmp_path / assets.GGUF_NAME, cfg, _params(cfg, 3))  # another model under the default name
    assert loading.shipped_drafter_path(dj.load_target(impostor)) is None
