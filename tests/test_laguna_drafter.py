"""Laguna DFlash drafter: config rules, safetensors and both GGUF layouts load to the same
parameters, fail-fast on missing aux norms / gates, and greedy-lossless speculative decoding on a
tiny Laguna target (prompts longer than the window, chunk sizes 1, 5 and whole prompt, scripted
rejections inside and across the window boundary)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decode import loop as decode
from dflash_jax.drafter.model import drafter_config_from_hf
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.drafter.model import load_hf_drafter as load_drafter
from dflash_jax.drafter.laguna import load_laguna_drafter_gguf
from dflash_jax.drafter import model as drafter, laguna as laguna_drafter
from laguna_tiny import LAGUNA_DRAFTER, PER_HEAD, tiny_laguna, write_config

gguf = pytest.importorskip("gguf")
PROMPT = [5, 17, 3, 42, 8, 9, 60, 33, 21, 7, 11, 2, 19, 44, 58, 13]  # 16 > window 5 (target), 6 (drafter)


@pytest.fixture(scope="module")
def target():
    return tiny_laguna(PER_HEAD, seed=4, max_block=4)


@pytest.fixture(scope="module")
def draft():
    cfg = drafter_config_from_hf(LAGUNA_DRAFTER)
    return cfg, drafter.init_params(cfg, jax.random.key(7), scale=0.3)


def np_params(p):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), p)


def write_safetensors(folder, cfg, p, drop=()):
    from safetensors.numpy import save_file

    p = np_params(p)
    L = p["layers"]
    t = {"fc.weight": p["fc"].T, "hidden_norm.weight": p["hidden_norm"], "norm.weight": p["norm"]}
    for j in range(len(cfg.target_layer_ids)):
        t[f"aux_hidden_norms.{j}.weight"] = p["aux_norm"][j]
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        t[pre + "self_attn.qkv_proj.weight"] = np.concatenate([L["wq"][i].T, L["wk"][i].T, L["wv"][i].T])
        for name, leaf, tr in (("input_layernorm", "attn_norm", 0), ("post_attention_layernorm", "mlp_norm", 0),
                               ("self_attn.o_proj", "wo", 1), ("self_attn.g_proj", "wg", 1), ("self_attn.q_norm", "q_norm", 0),
                               ("self_attn.k_norm", "k_norm", 0), ("mlp.gate_proj", "w_gate", 1), ("mlp.up_proj", "w_up", 1),
                               ("mlp.down_proj", "w_down", 1)):
            t[pre + name + ".weight"] = L[leaf][i].T if tr else L[leaf][i]
    t = {k: np.ascontiguousarray(v) for k, v in t.items() if not any(d in k for d in drop)}
    write_config(folder, LAGUNA_DRAFTER)
    save_file(t, os.path.join(folder, "model.safetensors"))
    return folder


def write_gguf(path, cfg, p, layout):
    p = np_params(p)
    L = p["layers"]
    arch = "dflash-draft" if layout == "ik" else "dflash"
    w = gguf.GGUFWriter(str(path), arch)
    pre = arch + "."
    w.add_uint32(pre + "block_count", cfg.num_hidden_layers)
    w.add_uint32(pre + "embedding_length", cfg.hidden_size)
    w.add_uint32(pre + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(pre + "attention.head_count", cfg.num_attention_heads)
    w.add_uint32(pre + "attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(pre + "attention.key_length", cfg.head_dim)
    w.add_float32(pre + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(pre + "rope.freq_base", cfg.rope.theta)
    w.add_uint32(pre + "context_length", 256)
    if layout == "ik":
        w.add_uint32(pre + "attention.value_length", cfg.head_dim)
        w.add_bool(pre + "attention.causal", True)
        w.add_uint32(pre + "attention.sliding_window", cfg.layer_window[0])
        w.add_uint32(pre + "dflash.block_size", cfg.block_size)
        w.add_uint32(pre + "dflash.mask_token_id", cfg.mask_token_id)
        w.add_array(pre + "dflash.target_layer_ids", list(cfg.target_layer_ids))
        w.add_uint32(pre + "dflash.n_target_features", len(cfg.target_layer_ids) * cfg.hidden_size)
        w.add_bool(pre + "dflash.laguna", True)
        glob = {"dflash_fc.weight": p["fc"].T, "dflash_hidden_norm.weight": p["hidden_norm"], "output_norm.weight": p["norm"]}
        for j in range(len(cfg.target_layer_ids)):
            glob[f"dflash_aux_hidden_norm.{j}.weight"] = p["aux_norm"][j]
        mlp_norm = "post_attention_norm"
    else:
        w.add_uint32(pre + "block_size", cfg.block_size)
        w.add_array(pre + "target_layers", [i + 1 for i in cfg.target_layer_ids])
        w.add_string(pre + "decoder_arch", "laguna")
        w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
        glob = {"fc.weight": p["fc"].T, "enc.aux_norm.weight": p["aux_norm"], "enc.output_norm.weight": p["hidden_norm"],
                "output_norm.weight": p["norm"]}
        mlp_norm = "ffn_norm"
    for name, arr in glob.items():
        w.add_tensor(name, np.ascontiguousarray(arr))
    for i in range(cfg.num_hidden_layers):
        for gg, leaf, tr in (("attn_norm", "attn_norm", 0), (mlp_norm, "mlp_norm", 0), ("attn_q", "wq", 1), ("attn_k", "wk", 1),
                             ("attn_v", "wv", 1), ("attn_output", "wo", 1), ("attn_gate", "wg", 1), ("attn_q_norm", "q_norm", 0),
                             ("attn_k_norm", "k_norm", 0), ("ffn_gate", "w_gate", 1), ("ffn_up", "w_up", 1), ("ffn_down", "w_down", 1)):
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(L[leaf][i].T if tr else L[leaf][i]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_config_rules(draft):
    cfg, _ = draft
    assert cfg.architecture == "DFlashLagunaForCausalLM" and cfg.gate == "head" and cfg.layer_causal == (True, True)
    assert cfg.layer_window == (6, 6) and cfg.rope.theta == 500000.0 and cfg.target_layer_ids == (0, 2)
    no_hd = {k: v for k, v in LAGUNA_DRAFTER.items() if k != "head_dim"}
    assert drafter_config_from_hf(no_hd).head_dim == 128  # Laguna default, not hidden // heads = 8
    eagle = dict(LAGUNA_DRAFTER, eagle_aux_hidden_state_layer_ids=[1, 3])
    assert drafter_config_from_hf(eagle).target_layer_ids == (0, 2)
    with pytest.raises(DFlashError, match="eagle_aux_hidden_state_layer_ids"):
        drafter_config_from_hf(dict(LAGUNA_DRAFTER, eagle_aux_hidden_state_layer_ids=[0, 2]))
    with pytest.raises(DFlashError, match="draft_vocab_size"):
        drafter_config_from_hf(dict(LAGUNA_DRAFTER, draft_vocab_size=50))


def test_all_layouts_load_same_params(tmp_path, target, draft):
    cfg_t, _ = target
    cfg, p = draft
    c1, p1 = load_drafter(write_safetensors(str(tmp_path / "st"), cfg, p), cfg_t)
    c2, p2 = load_laguna_drafter_gguf(write_gguf(tmp_path / "ik.gguf", cfg, p, "ik"), cfg_t, sliding_window=6)
    c3, p3 = load_laguna_drafter_gguf(write_gguf(tmp_path / "main.gguf", cfg, p, "mainline"), cfg_t, sliding_window=6)
    for c in (c1, c2, c3):
        assert dataclasses.replace(c, gating_explicit=False) == dataclasses.replace(cfg, gating_explicit=False)
    for other in (p1, p2, p3):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p, other)


def test_missing_aux_norms_or_gates_refused(tmp_path, target, draft):
    cfg_t, _ = target
    cfg, p = draft
    with pytest.raises(DFlashError, match=r"aux_hidden_norms\.0\.weight, aux_hidden_norms\.1\.weight"):
        load_drafter(write_safetensors(str(tmp_path / "a"), cfg, p, drop=("aux_hidden_norms",)), cfg_t)
    with pytest.raises(DFlashError, match=r"layers\.0\.self_attn\.g_proj\.weight"):
        load_drafter(write_safetensors(str(tmp_path / "g"), cfg, p, drop=("g_proj",)), cfg_t)


def test_drafter_not_fitting_target_refused(tmp_path, target, draft):
    cfg_t, _ = target
    cfg, p = draft
    folder = write_safetensors(str(tmp_path / "d"), cfg, p)
    write_config(folder, dict(LAGUNA_DRAFTER, dflash_config=dict(LAGUNA_DRAFTER["dflash_config"], target_layer_ids=[0, 4])))
    with pytest.raises(DFlashError, match="target_layer_ids"):
        load_drafter(folder, cfg_t)


def test_aux_norm_and_context_input_norm_matter(draft):
    """Each Laguna-specific op changes the context K/V (B17: an ablation must be detectable)."""
    cfg, p = draft
    feats = jax.random.normal(jax.random.key(1), (1, 5, 2 * cfg.hidden_size)) * jnp.asarray([1.0] * 32 + [30.0] * 32)
    pos = jnp.arange(5)[None]
    k, v = laguna_drafter.context_kv(p, cfg, feats, pos)
    ones = dict(p, aux_norm=jnp.ones_like(p["aux_norm"]))
    k2, _ = laguna_drafter.context_kv(ones, cfg, feats, pos)
    assert float(jnp.max(jnp.abs(k - k2))) > 1e-3
    c = laguna_drafter.fuse(p, cfg, feats)
    v_no_in = jnp.einsum("bth,lhd->lbtd", c, p["layers"]["wv"]).reshape(v.shape)
    assert float(jnp.max(jnp.abs(v - v_no_in))) > 1e-3


# ----------------------------------------------------------------------------- speculative decoding


def plain_greedy(target, prompt, n_new, max_len=48):
    cfg, params = target
    st = decode.init_state(Decoding(cfg), [prompt], max_len, n_new)
    st = decode.decode_loop(Params(params), decode.prefill(Params(params), st, Decoding(cfg), 4), Decoding(cfg))
    return [int(t) for t in np.asarray(st.tokens[0, len(prompt) : int(st.length[0])])]


@pytest.mark.parametrize("chunk", [1, 5, len(PROMPT)])
def test_spec_greedy_lossless(target, draft, chunk):
    cfg, params = target
    dcfg, dparams = draft
    want = plain_greedy(target, PROMPT, 14)
    st = decode.init_state(Decoding(cfg, dcfg), [PROMPT], 48, 14)
    st = decode.decode_loop(Params(params, dparams), decode.prefill(Params(params, dparams), st, Decoding(cfg, dcfg), chunk), Decoding(cfg, dcfg))
    assert [int(t) for t in np.asarray(st.tokens[0, len(PROMPT) : int(st.length[0])])] == want


@pytest.mark.parametrize("corrupt_at", [None, 0, 2])
def test_scripted_rejections_across_window(target, draft, corrupt_at):
    """Drafts from the target's own greedy continuation, wrong at ``corrupt_at``: every block
    is rolled back there; blocks straddle position multiples of the window and ring size."""
    from test_spec import scripted_run

    n_new = 14
    st, accepts, ref = scripted_run(target, draft, PROMPT, n_new, corrupt_at=corrupt_at, max_len=48)
    n = draft[0].block_size - 1
    assert [int(t) for t in np.asarray(st.tokens[0, len(PROMPT) : int(st.length[0])])] == ref[:n_new]
    if corrupt_at is not None:
        assert all(a <= corrupt_at for a in accepts) and accepts[0] == corrupt_at
    else:
        assert accepts[0] == n
