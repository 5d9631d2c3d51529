"""Laguna target: parity with transformers' ``LagunaForCausalLM``, cached decoding, loading.

Oracles: transformers 5.24 ``modeling_laguna.py`` on tiny random configs (per-head and
per-element gates, sliding window shorter than the prompt, YaRN with partial rotary, a non-zero
``e_score_correction_bias``, dense then sparse layers), a no-cache recompute for greedy decoding,
and the published parameter count of XS-2.1.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decode import loop as decode
from dflash_jax.families.laguna.config import laguna_config_from_hf
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.families.laguna.safetensors import load_laguna_target, parameter_count, published_shapes, save_published
from dflash_jax.families.laguna import model as laguna
from dflash_jax.families.laguna.presets import PUBLISHED
from dflash_jax.nn.layer import rope_tables, yarn_scale
from laguna_tiny import PER_ELEMENT, PER_HEAD, recompute_greedy, tiny_laguna, write_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = [5, 17, 3, 42, 8, 9, 60, 33, 21, 7, 11, 2, 19, 44, 58, 13, 25, 31, 23, 70]
PROMPT_LEN = 13


def hf_model(hf: dict, seed: int):
    from transformers import LagunaConfig, LagunaForCausalLM

    conf = LagunaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    conf._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LagunaForCausalLM(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.25 * torch.randn_like(p))
        for name, b in model.named_parameters(remove_duplicate=False):
            pass
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.2 * torch.randn_like(mod.e_score_correction_bias))
    return model


def save_hf(model, folder, hf: dict):
    from safetensors.torch import save_file

    write_config(folder, hf)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(folder, "model.safetensors"))
    return folder


@pytest.fixture(scope="module", params=["per_head", "per_element"])
def pair(request, tmp_path_factory):
    hf = PER_HEAD if request.param == "per_head" else PER_ELEMENT
    model = hf_model(hf, seed=1)
    folder = save_hf(model, str(tmp_path_factory.mktemp(request.param)), hf)
    cfg, params = load_laguna_target(folder)
    cfg = dataclasses.replace(cfg, max_block=3)  # ring = window + 3 rows < prompt
    with torch.no_grad():
        ref = model(torch.tensor([SEQ])).logits[0].numpy()
    return hf, model, folder, cfg, params, ref


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def test_full_forward_matches_transformers(pair):
    hf, _, _, cfg, params, ref = pair
    assert cfg.gate_per_head[0] == (hf["gating"] == "per-head")
    assert any(np.abs(np.asarray(params[k]["router_bias"])).max() > 0 for k in params if isinstance(params[k], dict) and "router_bias" in params[k])
    n = len(SEQ)
    logits, _, _ = jax.jit(lambda p: laguna.MODEL.forward(p, cfg, jnp.asarray([SEQ]), jnp.arange(n)[None], laguna.MODEL.init_cache(cfg, 1, 32)))(params)
    assert rel(logits[0], ref) < 1e-4


def test_chunked_prefill_then_decode_matches_transformers(pair):
    _, _, _, cfg, params, ref = pair
    step = jax.jit(lambda p, t, pos, c: laguna.MODEL.forward(p, cfg, t, pos, c))
    cache = laguna.MODEL.init_cache(cfg, 1, 32)
    toks = jnp.asarray([SEQ])
    out = []
    chunk = 5
    for s in range(0, PROMPT_LEN - PROMPT_LEN % chunk, chunk):
        lg, cache, _ = step(params, toks[:, s : s + chunk], jnp.arange(s, s + chunk)[None], cache)
        out.append(lg[0])
    for s in range(PROMPT_LEN - PROMPT_LEN % chunk, len(SEQ)):  # token by token past the window
        lg, cache, _ = step(params, toks[:, s : s + 1], jnp.asarray([[s]]), cache)
        out.append(lg[0])
    first_sliding = cfg.layer_types.index("sliding_attention")
    assert cache.kv[laguna.layer_slot(cfg, first_sliding)[0]][0].shape[2] == cfg.sliding_window + 3 < len(SEQ)
    assert rel(jnp.concatenate(out), ref) < 1e-4


def test_greedy_decode_equals_no_cache_recompute():
    cfg, params = tiny_laguna(PER_HEAD, seed=2, max_block=2)
    prompt = SEQ[:PROMPT_LEN]  # 13 tokens > window 5, > ring 7
    want = recompute_greedy(params, cfg, prompt, 10, buf=32)
    for chunk in (4, PROMPT_LEN):
        st = decode.init_state(Decoding(cfg), [prompt], 32, 10)
        st = decode.decode_loop(Params(params), decode.prefill(Params(params), st, Decoding(cfg), chunk), Decoding(cfg))
        got = [int(t) for t in np.asarray(st.tokens[0, PROMPT_LEN : int(st.length[0])])]
        assert got == want, chunk


def test_continuous_batching_replaces_ring_rows():
    """``decode.replace_rows`` on a Laguna state swaps the sliding layers' ring rows and their
    positions too: a row refilled after the ring has wrapped answers its new prompt exactly as a
    no-cache recomputation, while the other row goes on unchanged."""
    cfg, params = tiny_laguna(PER_HEAD, seed=2, max_block=2)
    a, b, c = SEQ[:PROMPT_LEN], SEQ[3:9], SEQ[1:12]
    st = decode.prefill(Params(params), decode.init_state(Decoding(cfg), [a, b], 32, [4, 10]), Decoding(cfg), 4)
    st = decode.generate_until(Params(params), st, Decoding(cfg), jnp.int32(1))
    fresh = decode.prefill(Params(params), decode.init_state(Decoding(cfg), [c], 32, 8), Decoding(cfg), 4)
    st = decode.generate_until(Params(params), decode.replace_rows(st, fresh, jnp.asarray([0], jnp.int32)), Decoding(cfg), jnp.int32(2))
    toks, length = np.asarray(st.tokens), np.asarray(st.length)
    assert toks[0, len(c) : length[0]].tolist() == recompute_greedy(params, cfg, c, 8, buf=32)
    assert toks[1, len(b) : length[1]].tolist() == recompute_greedy(params, cfg, b, 10, buf=32)


def test_published_names_roundtrip(pair, tmp_path):
    hf, _, _, cfg, params, _ = pair
    folder = write_config(str(tmp_path / "pub"), hf)
    save_published(os.path.join(folder, "model.safetensors"), cfg, params)
    cfg2, params2 = load_laguna_target(folder)
    assert cfg2.gate_per_head == cfg.gate_per_head
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_gating_contradiction_and_missing_tensor_refused(pair, tmp_path):
    hf, _, folder, cfg, params, _ = pair
    other = "per-element" if hf["gating"] == "per-head" else "per-head"
    bad = write_config(str(tmp_path / "bad"), dict(hf, gating=other))
    os.symlink(os.path.join(folder, "model.safetensors"), os.path.join(bad, "model.safetensors"))
    with pytest.raises(DFlashError, match="g_proj.weight.*contradict gating"):
        load_laguna_target(bad)
    # gating true (legacy) trusts the g_proj width
    ok = write_config(str(tmp_path / "legacy"), dict(hf, gating=True))
    os.symlink(os.path.join(folder, "model.safetensors"), os.path.join(ok, "model.safetensors"))
    assert load_laguna_target(ok)[0].gate_per_head == cfg.gate_per_head


def test_config_errors_name_field():
    with pytest.raises(DFlashError, match="config.json: field layer_types"):
        laguna_config_from_hf(dict(PER_HEAD, layer_types=["full_attention"]))
    with pytest.raises(DFlashError, match="field gating"):
        laguna_config_from_hf(dict(PER_HEAD, gating="sometimes"))
    with pytest.raises(DFlashError, match="rope_type"):
        laguna_config_from_hf(dict(PER_HEAD, rope_parameters={"full_attention": {"rope_type": "longrope", "rope_theta": 1.0},
                                                               "sliding_attention": {"rope_theta": 1e4}}))


def test_yarn_attention_factor_applied_once():
    cfg = laguna_config_from_hf(PUBLISHED["S-2.1"])
    assert yarn_scale(cfg.rope_full) == pytest.approx(1.4852030263919618)
    xs = laguna_config_from_hf(PUBLISHED["XS-2.1"])
    assert yarn_scale(xs.rope_full) == 1.0  # the revision's literal value, transformers' rule
    assert yarn_scale(xs.rope_full, "derived") == pytest.approx(1.3465736, rel=1e-6)
    inv, _ = rope_tables(xs.rope_full, 128)
    assert inv.shape == (32,) and inv[1] == pytest.approx(0.6636012, rel=1e-6) and inv[-1] == pytest.approx(9.418307e-08, rel=1e-5)


@pytest.mark.parametrize("name", ["XS-2.1", "S-2.1", "M.1"])
def test_published_configs_tensor_sets(name):
    cfg = laguna_config_from_hf(PUBLISHED[name])
    shapes = published_shapes(cfg)
    L = cfg.num_hidden_layers
    n_dense = cfg.mlp_layer_types.count("dense")
    per_sparse = 9 + 1 + 4 + 3 * cfg.num_experts
    assert len(shapes) == 3 + n_dense * 12 + (L - n_dense) * per_sparse
    nh0 = cfg.heads_per_layer[0]
    g = shapes["model.layers.0.self_attn.g_proj.weight"]
    assert g == ((nh0, cfg.hidden_size) if name != "M.1" else (nh0 * 128, cfg.hidden_size))
    assert shapes[f"model.layers.{n_dense}.mlp.experts.255.down_proj.weight"] == (cfg.hidden_size, cfg.moe_intermediate_size)
    assert shapes[f"model.layers.{n_dense}.mlp.shared_expert.gate_proj.weight"] == (cfg.shared_expert_intermediate_size, cfg.hidden_size)
    if name == "XS-2.1":
        assert parameter_count(cfg) == 33_442_617_088
        assert shapes["model.layers.1.self_attn.q_proj.weight"] == (64 * 128, 2048)
        assert len(laguna.segments(cfg)) == 3
    if name == "S-2.1":
        assert parameter_count(cfg) == 117_561_977_600
