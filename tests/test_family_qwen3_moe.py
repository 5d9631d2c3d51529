"""The qwen3_moe family against transformers' ``Qwen3MoeForCausalLM`` (tiny random checkpoints saved
by transformers 5, float32, CPU): config, both expert layouts, logits (one pass and chunked prefill
plus decode, captured layers), greedy plain and DFlash decoding for one and several prefill chunks,
and z-lab's ``dflash_generate`` with a drafter that gets blocks accepted (same ids, same verify steps).

Two layer mixes: ``decoder_sparse_step=2`` (dense, sparse, dense, sparse) without
``norm_topk_prob``, and ``mlp_only_layers=[1]`` with ``norm_topk_prob`` and tied embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax.families.qwen3_moe.config import Qwen3MoeConfig  # noqa: E402
from dflash_jax.errors import DFlashError  # noqa: E402
from dflash_jax.families.qwen3_moe import model as qwen3_moe  # noqa: E402
from dflash_jax.families.registry import family_for_hf, load_hf_target  # noqa: E402
from dflash_jax.testing import tiny_drafter  # noqa: E402
from hf_oracle import check_logits_and_capture, rel_err, hf_greedy, hf_logits, ours_greedy, save_tiny  # noqa: E402

V, TOL = 96, 1e-4
_COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, rms_norm_eps=1e-5,
               initializer_range=0.1, max_position_embeddings=256)
CASES = {
    "step2": (dict(decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=False), (False, True, False, True)),
    "mlp_only": (dict(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=True), (True, False, True, True)),
}
_forward = jax.jit(qwen3_moe.MODEL.forward, static_argnums=1)




@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    extra, sparse = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = save_tiny("Qwen3MoeConfig", "Qwen3MoeForCausalLM", folder, seed=3, **_COMMON, **extra)
    cfg, params = load_hf_target(folder)
    return request.param, model, cfg, params, sparse, folder


def test_config_and_params(case):
    name, _, cfg, params, sparse, folder = case
    assert isinstance(cfg, Qwen3MoeConfig) and cfg.sparse_layers == sparse and cfg.num_experts == 8
    assert cfg.norm_topk_prob == (name == "mlp_only") and ("lm_head" in params) == (name == "step2")
    shapes = jax.tree_util.tree_map(lambda a: tuple(a.shape), params)
    assert shapes == jax.tree_util.tree_map(tuple, qwen3_moe.MODEL.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def test_logits_and_capture_match_transformers(case):
    _, model, cfg, params, _, _ = case
    check_logits_and_capture(model, cfg, params, qwen3_moe.MODEL, (0, 2), TOL)


def test_greedy_plain_and_dflash_match_transformers(case):
    """One prefill chunk for one layer mix, chunks of 3 (and trees) for the other: both kinds of
    chunking and both layer mixes, at half the compilations of every pairing."""
    name, model, cfg, params, _, _ = case
    chunk = 32 if name == "step2" else 3
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 12
    want = hf_greedy(model, prompt, n)
    assert ours_greedy(cfg, params, prompt, n, chunk)[0] == want
    drafter = tiny_drafter(cfg, seed=1, layer_ids=(0, 2), block_size=4)
    assert ours_greedy(cfg, params, prompt, n, chunk, drafter)[0] == want
    if chunk == 3:  # tree verification too (a tree's RoPE positions and mask; its accepted path moved)
        assert ours_greedy(cfg, params, prompt, n, chunk, drafter, tree=3)[0] == want


def test_fused_expert_layout_loads_the_same(case, tmp_path):
    """transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj`` give the same params as the
    per-expert tensors; one without the other is refused by name."""
    from safetensors.numpy import load_file, save_file

    _, _, cfg, params, sparse, folder = case
    tensors = load_file(str(folder / "model.safetensors"))
    E = cfg.num_experts
    for i, s in enumerate(sparse):
        if not s:
            continue
        pre = f"model.layers.{i}.mlp.experts."
        gate, up, down = ([tensors.pop(f"{pre}{e}.{p}.weight") for e in range(E)] for p in ("gate_proj", "up_proj", "down_proj"))
        tensors[pre + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        tensors[pre + "down_proj"] = np.stack(down)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _, fused = load_hf_target(tmp_path)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), fused, params))
    first = sparse.index(True)
    del tensors[f"model.layers.{first}.mlp.experts.down_proj"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashError, match=rf"tensor model\.layers\.{first}\.mlp\.experts\.down_proj.*missing"):
        load_hf_target(tmp_path)


def test_config_fields_named():
    base = dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    fam = family_for_hf(base)
    assert fam.name == "qwen3_moe"
    with pytest.raises(DFlashError, match="c.json: field mlp_only_layers"):
        fam.parse_hf(dict(base, mlp_only_layers=[9]), "c.json")
    with pytest.raises(DFlashError, match="c.json: field num_experts"):
        fam.parse_hf({k: v for k, v in base.items() if k != "num_experts"}, "c.json")
    with pytest.raises(DFlashError, match="c.json: field use_sliding_window"):
        fam.parse_hf(dict(base, use_sliding_window=True), "c.json")


def test_same_tokens_and_verify_steps_as_zlab_dflash_generate(case, tmp_path):
    """z-lab's reference loop on the transformers target and a steered drafter (blocks accepted)
    gives the tokens and verify steps ours gives on the loaded checkpoints."""
    name, model, cfg, params, _, _ = case
    if name != "mlp_only":
        pytest.skip("one layer mix is enough for the loop")
    zlab = pytest.importorskip("dflash.model")
    from hf_oracle import zlab_matches_ours

    zlab_matches_ours(zlab, model, cfg, params, tmp_path, [3, 17, 42, 8, 11, 5, 29], 24, V, 64)


def _write_gguf_from_hf(folder, path, cfg_hf: dict) -> None:
    """A ``qwen3moe`` GGUF of an HF folder as ``convert_hf_to_gguf.py`` lays it out: names from
    ``gguf-py``'s own ``TensorNameMap`` for the architecture, each layer's experts stacked
    ``[E, out, in]``, sizes under llama.cpp's metadata keys."""
    import gguf
    from safetensors.numpy import load_file

    from tiny_gguf import write_gguf

    tensors, n = load_file(str(folder / "model.safetensors")), cfg_hf["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, n)
    for i in range(n):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if f"model.layers.{i}.mlp.experts.0.{proj}.weight" in tensors:  # a sparse layer
                experts = [tensors.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(cfg_hf["num_experts"])]
                tensors[f"model.layers.{i}.mlp.experts.{proj}.weight"] = np.stack(experts)
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n)  # a dense layer's MLP: no qwen3moe name exists
    out = [(name_map.get_name(k, try_suffixes=(".weight", ".bias")) or dense_map.get_name(k, try_suffixes=(".weight", ".bias")), v, None)
           for k, v in tensors.items()]
    kv = {"qwen3moe.embedding_length": cfg_hf["hidden_size"], "qwen3moe.block_count": n,
          "qwen3moe.feed_forward_length": cfg_hf["intermediate_size"], "qwen3moe.attention.head_count": cfg_hf["num_attention_heads"],
          "qwen3moe.attention.head_count_kv": cfg_hf["num_key_value_heads"], "qwen3moe.attention.key_length": cfg_hf["head_dim"],
          "qwen3moe.attention.value_length": cfg_hf["head_dim"], "qwen3moe.attention.layer_norm_rms_epsilon": cfg_hf["rms_norm_eps"],
          "qwen3moe.rope.freq_base": 10000.0, "qwen3moe.context_length": cfg_hf["max_position_embeddings"],
          "qwen3moe.expert_count": cfg_hf["num_experts"], "qwen3moe.expert_used_count": cfg_hf["num_experts_per_tok"],
          "qwen3moe.expert_feed_forward_length": cfg_hf["moe_intermediate_size"]}
    write_gguf(path, "qwen3moe", kv, out)


def test_gguf_loads_what_safetensors_load(tmp_path):
    """A ``qwen3moe`` GGUF (every layer MoE, top-k renormalised: what llama.cpp's graph runs) loads
    to the params of the safetensors it came from and to transformers' logits; a dense layer is
    refused by name."""
    from dflash_jax.families.registry import load_gguf_target

    conf = dict(_COMMON, num_hidden_layers=2, decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)
    model = save_tiny("Qwen3MoeConfig", "Qwen3MoeForCausalLM", tmp_path / "hf", seed=5, **conf)
    cfg, params = load_hf_target(tmp_path / "hf")
    _write_gguf_from_hf(tmp_path / "hf", tmp_path / "m.gguf", conf)
    g_cfg, g_params = load_gguf_target(tmp_path / "m.gguf", use_cache=False)
    assert g_cfg == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), g_params, params))
    tokens = np.random.default_rng(2).integers(0, V, (1, 9)).astype(np.int32)
    got, _, _ = _forward(g_params, g_cfg, jnp.asarray(tokens), jnp.arange(9, dtype=jnp.int32)[None], qwen3_moe.MODEL.init_cache(g_cfg, 1, 9))
    assert rel_err(got, hf_logits(model, tokens)) < TOL
    dense_layer = dict(conf, mlp_only_layers=[1])
    save_tiny("Qwen3MoeConfig", "Qwen3MoeForCausalLM", tmp_path / "hf2", seed=5, **dense_layer)
    _write_gguf_from_hf(tmp_path / "hf2", tmp_path / "d.gguf", dense_layer)
    with pytest.raises(DFlashError, match=r"tensor blk\.1\.ffn_gate_inp\.weight: missing"):
        load_gguf_target(tmp_path / "d.gguf", use_cache=False)



_EXPERT_MESH = """
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from dflash_jax.decode import loop as decode
from dflash_jax.decode.prefill import prefill
from dflash_jax.runtime import sharding as shd
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.families.registry import family_for_hf, module_for
from dflash_jax.testing import tiny_drafter

hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          decoder_sparse_step=2, norm_topk_prob=True)
cfg = family_for_hf(hf).parse_hf(hf, "hf")
m = module_for(cfg)
p = m.init_params(cfg, jax.random.key(3), 0.3)
dcfg, dp = tiny_drafter(cfg, seed=1, layer_ids=(0, 2))
static = Decoding(cfg, dcfg)

def run(p, mesh=None):
    st = decode.init_state(static, [[5, 9, 17, 3], [40, 2, 7]], 24, 10)
    st = st if mesh is None else shd.shard_state(st, mesh)
    return decode.decode_loop(Params(p, dp), prefill(Params(p, dp), st, static, 4), static)

mesh = shd.make_mesh(model=2, expert=2)
sp = shd.shard_params(p, m.param_axes(cfg), mesh)
e = sp["seg0_1"]["e_gate"]
assert e.sharding.shard_shape(e.shape) == (e.shape[0], e.shape[1] // 2, e.shape[2], e.shape[3] // 2), e.sharding
a, b = run(p), run(sp, mesh)
assert (np.asarray(a.tokens) == np.asarray(b.tokens)).all() and (np.asarray(a.length) == np.asarray(b.length)).all()
print("OK")
"""


@pytest.mark.slow
def test_experts_split_over_the_expert_axis_answer_as_one_device():
    """``param_axes`` puts experts on the mesh's ``expert`` axis and each expert's width on
    ``model``: DFlash greedy decoding on 4 CPU devices (expert=2, model=2) gives one device's tokens."""
    from conftest import run_on_cpu_devices

    run_on_cpu_devices(_EXPERT_MESH, 4, timeout=600)
