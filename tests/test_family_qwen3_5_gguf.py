"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``) in the qwen3_5 family, and the family's GGUF files
(llama.cpp ``qwen35``, ``qwen35moe``, ``qwen3next``). Oracles: transformers' logits, captured layers
and greedy tokens of tiny random checkpoints saved by ``save_pretrained``; GGUF files written
here from those checkpoints as llama.cpp's ``convert_hf_to_gguf.py`` lays them out (gguf-py's
name map, ``-exp(A_log)``, ``1 + w`` norms, value heads tiled) must load to the same config and
transformers' logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.families.qwen3_5 import model as qwen3_5
from dflash_jax.families.registry import load_gguf_target, load_hf_target
from dflash_jax.testing import tiny_drafter

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("transformers without Qwen3_5MoeForCausalLM", allow_module_level=True)

from hf_oracle import check_logits_and_capture, hf_greedy, ours_greedy  # noqa: E402

HF = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
          layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=512)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
VARIANTS = {  # variant: (config class, model class, extra fields, GGUF architecture)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=48, rope_parameters=ROPE), "qwen35"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(MOE, rope_parameters=ROPE), "qwen35moe"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(MOE, intermediate_size=48), "qwen3next"),
}
PROMPT = [5, 17, 3, 42, 8, 9, 60, 33, 21, 7, 11]


def _save(variant: str, folder: str, seed: int = 3):
    conf_cls, model_cls, extra, _ = VARIANTS[variant]
    conf = getattr(transformers, conf_cls)(**HF, **extra)
    conf._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.log(torch.rand_like(p) * 2 + 0.5) if name.endswith("A_log") else 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{variant: (hf model, folder)}`` of tiny random checkpoints of each variant."""
    out = {}
    for variant in VARIANTS:
        folder = str(tmp_path_factory.mktemp(variant))
        out[variant] = (_save(variant, folder), folder)
    return out


def test_qwen3_5_moe_and_its_gguf_match_transformers(saved, tmp_path):
    """``Qwen3_5MoeForCausalLM``: logits (one pass and chunks) and captured layers equal
    transformers', from the safetensors and from its ``qwen35moe`` GGUF."""
    model, folder = saved["qwen3_5_moe"]
    cfg, params = load_hf_target(folder)
    assert cfg.variant == "qwen3_5_moe" and cfg.sparse and params["linear"]["e_gate"].shape == (2, 4, 32, 16)
    check_logits_and_capture(model, cfg, params, qwen3_5.MODEL, layer_ids=(0, 2))
    g_cfg, g_params = load_gguf_target(_write_gguf("qwen3_5_moe", folder, tmp_path / "m.gguf"), use_cache=False)
    assert g_cfg == cfg
    check_logits_and_capture(model, g_cfg, g_params, qwen3_5.MODEL, layer_ids=(0, 2))  # compiled above: seconds


@pytest.mark.slow
def test_qwen3_5_moe_dflash_greedy_is_transformers_greedy(saved):
    """DFlash greedy decoding (prefill in chunks, blocks of 4) of Qwen3.5-MoE gives transformers'
    greedy tokens (about 30 s of compiling on a CPU: marked slow)."""
    model, folder = saved["qwen3_5_moe"]
    cfg, params = load_hf_target(folder)
    spec, steps = ours_greedy(cfg, params, PROMPT, 12, 4, tiny_drafter(cfg, layer_ids=(0, 2), block_size=4), max_len=48)
    assert spec == hf_greedy(model, PROMPT, 12) and steps > 0


def test_qwen3_5_moe_stacked_experts(saved, tmp_path):
    """The published Qwen3.5-MoE layout (``mlp.experts.gate_up_proj`` ``[E, 2 Im, H]``, gate rows
    first, and ``mlp.experts.down_proj``) loads to the per-expert checkpoint's params."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = saved["qwen3_5_moe"][1]
    tensors = load_file(f"{folder}/model.safetensors")
    for i in range(HF["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp.experts."
        pop = {p: np.stack([tensors.pop(f"{pre}{e}.{p}.weight") for e in range(MOE["num_experts"])]) for p in ("gate_proj", "up_proj", "down_proj")}
        tensors[pre + "gate_up_proj"] = np.concatenate([pop["gate_proj"], pop["up_proj"]], axis=1)
        tensors[pre + "down_proj"] = pop["down_proj"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{folder}/config.json", tmp_path / "config.json")
    want, got = load_hf_target(folder)[1], load_hf_target(tmp_path)[1]
    for kind in ("linear", "full"):
        for leaf in ("e_gate", "e_up", "e_down"):
            np.testing.assert_array_equal(np.asarray(got[kind][leaf]), np.asarray(want[kind][leaf]))


def _tiled(x: np.ndarray, axis: int, hk: int, d: int) -> np.ndarray:
    """llama.cpp's reorder of value heads along ``axis``: grouped by key head -> tiled."""
    s = x.shape
    return np.swapaxes(x.reshape(s[:axis] + (hk, x.shape[axis] // hk // d, d) + s[axis + 1:]), axis, axis + 1).reshape(s)


def _layer_tensor(variant: str, name: str, v: np.ndarray):
    """One HF tensor as the converter rewrites it: ``[(hf-style name, array)]``."""
    hk, hv, dk, dv = (HF[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    kd, r = hk * dk, hv // hk
    tile = (lambda x, axis, d: _tiled(x, axis, hk, d)) if variant != "qwen3_next" else (lambda x, axis, d: x)
    if "linear_attn." in name:
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            v = np.concatenate([v[: 2 * kd], tile(v[2 * kd:], 0, dv)])
        elif name.endswith("in_proj_z.weight"):
            v = tile(v, 0, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            v = tile(v, 0, 1)
        elif name.endswith("out_proj.weight"):
            v = tile(v, 1, dv)
    if name.endswith("A_log"):
        v = -np.exp(v)
    elif name.endswith("dt_bias"):
        name = name.replace("dt_bias", "dt_proj.bias")
    elif "conv1d" in name:
        v = v[:, 0, :]
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        v = v + 1
    if name.endswith("in_proj_qkvz.weight"):  # grouped per key head [q, k, v, z] -> [q all | k all | v all], z
        g = v.reshape(hk, 2 * dk + 2 * r * dv, -1)
        qkv = np.concatenate([g[:, :dk].reshape(kd, -1), g[:, dk : 2 * dk].reshape(kd, -1), g[:, 2 * dk : 2 * dk + r * dv].reshape(hv * dv, -1)])
        return [(name.replace("in_proj_qkvz", "in_proj_qkv"), qkv), (name.replace("in_proj_qkvz", "in_proj_z"), g[:, 2 * dk + r * dv:].reshape(hv * dv, -1))]
    return [(name, v)]


def _write_gguf(variant: str, folder: str, path, drop=(), mtp=False, **kv_changes) -> str:
    """A GGUF of an HF folder laid out as ``convert_hf_to_gguf.py`` writes ``variant`` (module
    docstring): names from gguf-py's ``TensorNameMap`` of the architecture, experts stacked
    ``[E, out, in]``, sizes under llama.cpp's metadata keys (``drop``: keys left out). ``mtp``: a
    multi-token-prediction block appended as newer converters do (``blk.{n}.nextn.*`` and a copy of
    the last layer's tensors, ``block_count`` n + 1, ``nextn_predict_layers`` 1)."""
    import gguf
    from safetensors.numpy import load_file

    from tiny_gguf import write_gguf

    arch, n, extra = VARIANTS[variant][3], HF["num_hidden_layers"], VARIANTS[variant][2]
    hf = load_file(f"{folder}/model.safetensors")
    for i in range(n if "num_experts" in extra else 0):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            hf[f"model.layers.{i}.mlp.experts.{proj}.weight"] = np.stack([hf.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight")
                                                                          for e in range(MOE["num_experts"])])
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n)
    out = []
    for k, v in hf.items():
        for name, arr in _layer_tensor(variant, k, v):
            out.append((name_map.get_name(name, try_suffixes=(".weight", ".bias")), arr, None))
    if mtp:
        out += [(f"blk.{n}.nextn.{k}.weight", np.ones(HF["hidden_size"], np.float32), None) for k in ("enorm", "hnorm")]
        out += [(name.replace(f"blk.{n - 1}.", f"blk.{n}."), arr, None) for name, arr, _ in out if name.startswith(f"blk.{n - 1}.")]
        kv_changes = dict(kv_changes, block_count=n + 1, nextn_predict_layers=1)
    kv = {"embedding_length": HF["hidden_size"], "block_count": n, "attention.head_count": HF["num_attention_heads"],
          "attention.head_count_kv": HF["num_key_value_heads"], "attention.key_length": HF["head_dim"], "attention.value_length": HF["head_dim"],
          "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0, "context_length": HF["max_position_embeddings"],
          "rope.dimension_count": HF["head_dim"] // (2 if variant != "qwen3_next" else 4), "ssm.conv_kernel": HF["linear_conv_kernel_dim"],
          "ssm.state_size": HF["linear_key_head_dim"], "ssm.group_count": HF["linear_num_key_heads"],
          "ssm.time_step_rank": HF["linear_num_value_heads"], "ssm.inner_size": HF["linear_value_head_dim"] * HF["linear_num_value_heads"],
          "full_attention_interval": 2}
    if "intermediate_size" in extra:
        kv["feed_forward_length"] = extra["intermediate_size"]
    if "num_experts" in extra:
        kv.update({"expert_count": MOE["num_experts"], "expert_used_count": MOE["num_experts_per_tok"],
                   "expert_feed_forward_length": MOE["moe_intermediate_size"], "expert_shared_feed_forward_length": MOE["shared_expert_intermediate_size"]})
    kv = {f"{arch}.{k}": v for k, v in dict(kv, **kv_changes).items() if k not in drop}
    return write_gguf(path, arch, kv, out, [f"t{i}" for i in range(HF["vocab_size"])])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_loads_what_safetensors_load(saved, variant, tmp_path):
    """Each architecture's GGUF gives the config and params of the safetensors it came from (whose
    logits equal transformers': here for Qwen3.5-MoE, test_family_qwen3_5.py for the others):
    value heads untiled, ``A_log`` recovered, ``attn_q`` split into query and gate, the grouped
    ``ssm_ba`` of ``qwen3next`` split; an appended MTP block (``qwen35moe`` here) skipped."""
    folder = saved[variant][1]
    cfg, params = load_hf_target(folder)
    g_cfg, g_params = load_gguf_target(_write_gguf(variant, folder, tmp_path / "m.gguf", mtp=variant == "qwen3_5_moe"), use_cache=False)
    assert g_cfg == cfg
    flat, g_flat = jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(g_params)
    assert len(flat) == len(g_flat)
    for (where, want), got in zip(flat, g_flat):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(where))


def test_gguf_bad_metadata_and_tensors_named(saved, tmp_path):
    folder = saved["qwen3_5_moe"][1]
    with pytest.raises(DFlashError, match=r"b\.gguf: metadata qwen35moe\.ssm\.group_count: missing"):
        load_gguf_target(_write_gguf("qwen3_5_moe", folder, tmp_path / "b.gguf", drop=("ssm.group_count",)), use_cache=False)
    with pytest.raises(DFlashError, match=r"c\.gguf: metadata qwen35moe\.ssm\.inner_size: 30 is not a multiple"):
        load_gguf_target(_write_gguf("qwen3_5_moe", folder, tmp_path / "c.gguf", **{"ssm.inner_size": 30}), use_cache=False)
    with pytest.raises(DFlashError, match=r"d\.gguf: metadata qwen35moe\.expert_count: missing"):
        load_gguf_target(_write_gguf("qwen3_5_moe", folder, tmp_path / "d.gguf", drop=("expert_count",)), use_cache=False)
    with pytest.raises(DFlashError, match=r"f\.gguf: metadata qwen35moe\.nextn_predict_layers: got 4"):
        load_gguf_target(_write_gguf("qwen3_5_moe", folder, tmp_path / "f.gguf", nextn_predict_layers=4), use_cache=False)
    with pytest.raises(DFlashError, match=r"e\.gguf: tensor blk\.1\.\w+\.weight: missing"):  # every 3rd layer full: 1 is linear
        load_gguf_target(_write_gguf("qwen3_5_moe", folder, tmp_path / "e.gguf", **{"full_attention_interval": 3}), use_cache=False)
