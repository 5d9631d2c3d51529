"""Laguna target GGUF (``general.architecture = "laguna"``, ``docs/specs/laguna.md`` 4.2).

A tiny Laguna is written with ``gguf.GGUFWriter`` under the published llama.cpp key and tensor
names (what ``conversion/laguna.py`` emits: per-layer head counts, a sliding-window period or a
per-layer pattern, ``rope.dimension_count`` already partial, YaRN keys of the full layers,
stacked experts, ``exp_probs_b.bias``) from the weights of a published-layout safetensors
checkpoint; ``load_gguf_target`` must return the same config and bit-identical parameters as
``load_laguna_target`` on that checkpoint. Bad files fail naming the file and key or tensor.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.families import registry
from dflash_jax.families.laguna.safetensors import load_laguna_target, save_published
from dflash_jax.families.laguna.gguf import load_laguna_gguf_target
from dflash_jax.families.laguna.model import layer_slot
from laguna_tiny import PER_ELEMENT, PER_HEAD, tiny_laguna, write_config

gguf = pytest.importorskip("gguf")


def gguf_tensors(cfg, p) -> dict:
    """``{GGUF name: numpy array in ggml-reversed (numpy) order}`` from a Laguna params tree."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), p)
    out = {"token_embd.weight": p["embed"], "output_norm.weight": p["norm"]}
    if "lm_head" in p:
        out["output.weight"] = p["lm_head"].T
    for i in range(cfg.num_hidden_layers):
        key, r = layer_slot(cfg, i)
        L = {k: v[r] for k, v in p[key].items()}
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": L["attn_norm"], b + "ffn_norm.weight": L["mlp_norm"],
                    b + "attn_q.weight": L["wq"].T, b + "attn_k.weight": L["wk"].T, b + "attn_v.weight": L["wv"].T,
                    b + "attn_output.weight": L["wo"].T, b + "attn_gate.weight": L["wg"].T,
                    b + "attn_q_norm.weight": L["q_norm"], b + "attn_k_norm.weight": L["k_norm"]})
        if cfg.mlp_layer_types[i] == "dense":
            out.update({b + "ffn_gate.weight": L["w_gate"].T, b + "ffn_up.weight": L["w_up"].T, b + "ffn_down.weight": L["w_down"].T})
        else:
            out.update({b + "ffn_gate_inp.weight": L["router"].T, b + "exp_probs_b.bias": L["router_bias"],
                        b + "ffn_gate_exps.weight": L["e_gate"].swapaxes(1, 2), b + "ffn_up_exps.weight": L["e_up"].swapaxes(1, 2),
                        b + "ffn_down_exps.weight": L["e_down"].swapaxes(1, 2), b + "ffn_gate_shexp.weight": L["s_gate"].T,
                        b + "ffn_up_shexp.weight": L["s_up"].T, b + "ffn_down_shexp.weight": L["s_down"].T})
    return out


def swa_pattern(cfg):
    """A period ``p`` (full attention at ``i % p == 0``) when one fits, else a bool per layer."""
    sliding = [t == "sliding_attention" for t in cfg.layer_types]
    for p in range(1, cfg.num_hidden_layers + 1):
        if sliding == [i % p != 0 for i in range(cfg.num_hidden_layers)]:
            return p
    return sliding


def write_laguna_gguf(path, hf: dict, cfg, params, *, drop_keys=(), override=None, edit=None, tokens=True):
    """Writes ``params`` as a ``laguna`` GGUF with the keys llama.cpp's converter derives from ``hf``."""
    full, swa = hf["rope_parameters"]["full_attention"], hf["rope_parameters"]["sliding_attention"]
    D = hf["head_dim"]
    kv = {
        "block_count": ("uint32", hf["num_hidden_layers"]), "context_length": ("uint32", hf["max_position_embeddings"]),
        "embedding_length": ("uint32", hf["hidden_size"]), "feed_forward_length": ("uint32", hf["intermediate_size"]),
        "attention.head_count": ("array", list(hf["num_attention_heads_per_layer"])),
        "attention.head_count_kv": ("uint32", hf["num_key_value_heads"]),
        "attention.key_length": ("uint32", D), "attention.value_length": ("uint32", D),
        "attention.layer_norm_rms_epsilon": ("float32", hf["rms_norm_eps"]),
        "attention.sliding_window": ("uint32", hf["sliding_window"]),
        "attention.sliding_window_pattern": ("uint32", swa_pattern(cfg)) if isinstance(swa_pattern(cfg), int)
        else ("array", swa_pattern(cfg)),
        "rope.dimension_count": ("uint32", int(D * full.get("partial_rotary_factor", 1.0))),
        "rope.dimension_count_swa": ("uint32", int(D * swa.get("partial_rotary_factor", 1.0))),
        "rope.freq_base": ("float32", full["rope_theta"]), "rope.freq_base_swa": ("float32", swa["rope_theta"]),
        "expert_count": ("uint32", hf["num_experts"]), "expert_used_count": ("uint32", hf["num_experts_per_tok"]),
        "expert_feed_forward_length": ("uint32", hf["moe_intermediate_size"]),
        "expert_shared_feed_forward_length": ("uint32", hf["shared_expert_intermediate_size"]),
        "expert_weights_scale": ("float32", hf["moe_routed_scaling_factor"]), "expert_weights_norm": ("bool", True),
        "expert_gating_func": ("uint32", 2), "vocab_size": ("uint32", hf["vocab_size"]),
        "leading_dense_block_count": ("uint32", hf["mlp_layer_types"].index("sparse")),
    }
    if full.get("rope_type") == "yarn":
        kv.update({"rope.scaling.type": ("string", "yarn"), "rope.scaling.factor": ("float32", full["factor"]),
                   "rope.scaling.original_context_length": ("uint32", full["original_max_position_embeddings"]),
                   "rope.scaling.yarn_beta_fast": ("float32", full["beta_fast"]),
                   "rope.scaling.yarn_beta_slow": ("float32", full["beta_slow"])})
        if "attention_factor" in full:
            kv["rope.scaling.yarn_attn_factor"] = ("float32", full["attention_factor"])
    kv.update(override or {})
    w = gguf.GGUFWriter(str(path), "laguna")
    for k, (kind, v) in kv.items():
        if k not in drop_keys:
            getattr(w, f"add_{kind}")(f"laguna.{k}", v)
    if tokens:
        w.add_token_list([f"<t{i}>" for i in range(hf["vocab_size"])])
    tensors = gguf_tensors(cfg, params)
    if edit is not None:
        edit(tensors)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module", params=["per_head", "per_element"])
def ref(request, tmp_path_factory):
    """(hf, safetensors folder, cfg, params) loaded by the safetensors loader."""
    hf = PER_HEAD if request.param == "per_head" else PER_ELEMENT
    cfg0, params0 = tiny_laguna(hf, seed=5)
    folder = write_config(str(tmp_path_factory.mktemp(request.param)), hf)
    save_published(os.path.join(folder, "model.safetensors"), cfg0, params0)
    cfg, params = load_laguna_target(folder)
    return hf, folder, cfg, params


def assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_gguf_loads_same_config_and_params_as_safetensors(ref, tmp_path):
    hf, _, cfg, params = ref
    path = write_laguna_gguf(tmp_path / "t.gguf", hf, cfg, params)
    got_cfg, got = registry.load_gguf_target(path, as_numpy=True)
    assert got_cfg == cfg
    assert got_cfg.layer_types == tuple(hf["layer_types"]) and got_cfg.gate_per_head == cfg.gate_per_head
    assert_same(got, params)
    assert registry.load_gguf_config(path) == cfg
    # bfloat16 load keeps the router's selection bias in float32
    cfg16, p16 = load_laguna_gguf_target(path, "bfloat16")
    assert cfg16.dtype == "bfloat16"
    seg = next(k for k in p16 if k.startswith("seg") and "router_bias" in p16[k])
    assert p16[seg]["router_bias"].dtype == np.float32 and p16[seg]["wq"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(p16[seg]["router_bias"]), np.asarray(params[seg]["router_bias"]))


def test_tied_and_no_tokenizer(ref, tmp_path):
    hf, _, cfg, params = ref
    params = {k: v for k, v in params.items() if k != "lm_head"}
    path = write_laguna_gguf(tmp_path / "tied.gguf", hf, dataclasses.replace(cfg, tie_word_embeddings=True), params, tokens=False)
    got_cfg, got = registry.load_gguf_target(path, as_numpy=True)
    assert got_cfg.tie_word_embeddings and "lm_head" not in got
    assert_same(got, params)


def _bad(tmp_path, ref, name, **kw):
    hf, _, cfg, params = ref
    return write_laguna_gguf(tmp_path / name, hf, cfg, params, **kw)


@pytest.mark.parametrize("key", ["expert_count", "attention.key_length", "rope.scaling.factor", "attention.head_count"])
def test_missing_metadata_named(ref, tmp_path, key):
    path = _bad(tmp_path, ref, "meta.gguf", drop_keys=(key,))
    with pytest.raises(DFlashError, match=rf"meta\.gguf: metadata laguna\.{key}: missing"):
        registry.load_gguf_target(path)


def test_tensor_errors_named(ref, tmp_path):
    hf, _, cfg, _ = ref
    sparse = cfg.mlp_layer_types.index("sparse")
    path = _bad(tmp_path, ref, "miss.gguf", edit=lambda t: t.pop(f"blk.{sparse}.exp_probs_b.bias"))
    with pytest.raises(DFlashError, match=rf"miss\.gguf: tensor blk\.{sparse}\.exp_probs_b\.bias: missing"):
        registry.load_gguf_target(path)
    path = _bad(tmp_path, ref, "extra.gguf", edit=lambda t: t.update({"blk.0.ffn_gate_exps.weight": np.zeros((2, 2, 2))}))
    with pytest.raises(DFlashError, match=r"extra\.gguf: tensor blk\.0\.ffn_gate_exps\.weight: unexpected"):
        registry.load_gguf_target(path)
    path = _bad(tmp_path, ref, "shape.gguf", edit=lambda t: t.update({"blk.1.attn_k.weight": t["blk.1.attn_k.weight"][:-1]}))
    with pytest.raises(DFlashError, match=r"shape\.gguf: tensor blk\.1\.attn_k\.weight: ggml shape"):
        registry.load_gguf_target(path)
    path = _bad(tmp_path, ref, "gate.gguf", edit=lambda t: t.update({"blk.0.attn_gate.weight": t["blk.0.attn_gate.weight"][:3]}))
    with pytest.raises(DFlashError, match=r"gate\.gguf: tensor blk\.0\.attn_gate\.weight: 3 output rows"):
        registry.load_gguf_target(path)


def test_bad_metadata_values_named(tmp_path):
    hf = PER_HEAD
    cfg, params = tiny_laguna(hf, seed=6)
    bad_hf = dict(hf, num_attention_heads_per_layer=[4, 8, 8])  # 3 entries for 4 layers
    path = write_laguna_gguf(tmp_path / "heads.gguf", bad_hf, cfg, params)
    with pytest.raises(DFlashError, match=r"heads\.gguf: metadata laguna\.attention\.head_count: got \[4, 8, 8\]"):
        registry.load_gguf_target(path)
    for name, key, value, want in (("func", "expert_gating_func", ("uint32", 1), "2 \\(sigmoid\\)"),
                                   ("norm", "expert_weights_norm", ("bool", False), "true"),
                                   ("rope", "rope.scaling.type", ("string", "linear"), "none or yarn")):
        path = write_laguna_gguf(tmp_path / f"{name}.gguf", hf, cfg, params, override={key: value})
        with pytest.raises(DFlashError, match=rf"{name}\.gguf: metadata laguna\.{key}: .*{want}"):
            registry.load_gguf_target(path)
