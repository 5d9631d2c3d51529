"""The gemma4 family against transformers' ``Gemma4ForCausalLM`` (a tiny random checkpoint saved by
transformers 5, float32, CPU): config (and the options refused by name), logits (one pass and
chunked prefill plus decode, captured layers), greedy plain and DFlash decoding (chains and trees)
for one and several prefill chunks; the same for a KV-sharing / ``attention_k_eq_v`` checkpoint
and an MoE one, and a ``gemma4`` GGUF of each laid out as llama.cpp's converter does.

The main checkpoint mixes sliding (head 8, window 4) and full layers (head 16, proportional RoPE over a
quarter of the frequencies), has per-layer inputs, random layer scalars and a final-logit soft-cap
small enough to bite."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax.families.gemma4.config import Gemma4Config  # noqa: E402
from dflash_jax.errors import DFlashError  # noqa: E402
from dflash_jax.families.gemma4 import model as gemma4  # noqa: E402
from dflash_jax.families.registry import family_for_hf, load_hf_target  # noqa: E402
from dflash_jax.testing import tiny_drafter  # noqa: E402
from hf_oracle import check_logits_and_capture, rel_err, hf_greedy, hf_logits, ours_greedy, save_tiny  # noqa: E402

V, TOL = 96, 1e-4
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CONF = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, global_head_dim=16, sliding_window=4, layer_types=TYPES, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=V, final_logit_softcapping=3.0, rms_norm_eps=1e-6, initializer_range=0.1,
            max_position_embeddings=256)
_forward = jax.jit(gemma4.MODEL.forward, static_argnums=1)




@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4")
    model = save_tiny("Gemma4TextConfig", "Gemma4ForCausalLM", folder, seed=3, **CONF)
    with torch.no_grad():  # the layer scalars are buffers: off 1 too, then saved again
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.7 + 0.15 * i)
    model.save_pretrained(folder, safe_serialization=True)
    cfg, params = load_hf_target(folder)
    return model, cfg, params, folder


def test_config_and_params(case):
    _, cfg, params, _ = case
    assert isinstance(cfg, Gemma4Config) and cfg.layer_types == tuple(TYPES)
    assert cfg.head_dims == (8, 16) and cfg.kv_heads == (2, 2) and cfg.per_layer_input == 8 and cfg.final_logit_softcapping == 3.0
    assert cfg.ropes[1] == ("proportional", 1e6, 0.25, 1.0) and "lm_head" not in params
    shapes = jax.tree_util.tree_map(lambda a: tuple(a.shape), params)
    assert shapes == jax.tree_util.tree_map(tuple, gemma4.MODEL.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert abs(float(params["layer4"]["scalar"][0]) - 1.3) < 1e-6


def test_unsupported_options_refused_by_name(case):
    _, _, _, folder = case
    base = json.loads((folder / "config.json").read_text())
    fam = family_for_hf(base)
    assert fam.name == "gemma4"
    for key, value in (("num_kv_shared_layers", 5), ("hidden_activation", "silu"), ("use_bidirectional_attention", "all")):
        with pytest.raises(DFlashError, match=f"c.json: field {key}"):
            fam.parse_hf(dict(base, **{key: value}), "c.json")
    moe = dict(base, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8)
    assert fam.parse_hf(moe, "c.json").num_experts == 4 and fam.parse_hf(base, "c.json").num_experts == 0
    for key, value in (("num_experts", None), ("top_k_experts", 5), ("moe_intermediate_size", 0)):
        with pytest.raises(DFlashError, match=f"c.json: field {key}"):
            fam.parse_hf(dict(moe, **{key: value}), "c.json")
    rope = dict(base["rope_parameters"], full_attention={"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0})
    with pytest.raises(DFlashError, match="c.json: field rope_parameters.full_attention.rope_type"):
        fam.parse_hf(dict(base, rope_parameters=rope), "c.json")


def test_logits_and_capture_match_transformers(case):
    model, cfg, params, _ = case
    want = check_logits_and_capture(model, cfg, params, gemma4.MODEL, (1, 3), TOL)
    assert np.abs(want).max() > 2.0  # the soft-cap bites


def test_greedy_plain_and_dflash_match_transformers(case):
    """One prefill chunk plain and DFlash, chunks of 3 with DFlash trees, against transformers'
    greedy decode past the sliding window (chunks of 3 plain and DFlash chains: the KV-sharing test)."""
    model, cfg, params, _ = case
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 12
    want = hf_greedy(model, prompt, n)
    assert ours_greedy(cfg, params, prompt, n, 32)[0] == want
    drafter = tiny_drafter(cfg, seed=1, layer_ids=(1, 3), block_size=4)
    assert ours_greedy(cfg, params, prompt, n, 32, drafter)[0] == want
    # tree verification (a tree's RoPE positions, windows and mask; its accepted path moved)
    assert ours_greedy(cfg, params, prompt, n, 3, drafter, tree=3)[0] == want


def _draft_logits_match_zlab(zlab, draft, model, cfg, params, d_cfg, d_params, context):
    """One draft block's logits: z-lab's drafter (raw embedding times its scale, raw head, its cap)
    against ours (through the family's embed and lm_head)."""
    from dflash_jax.drafter import model as drafter
    from dflash_jax.families.registry import module_for

    c = len(context)
    block = [context[-1]] + [V - 1] * 3
    with torch.no_grad():
        hidden = model(torch.tensor([context]), output_hidden_states=True, use_cache=False).hidden_states
        ctx = zlab.extract_context_feature(hidden, [1, 3])
        noise = zlab._raw_input_embeddings(model, torch.tensor([block]), float(draft.config.dflash_config["input_embedding_scale"]))
        h = draft(position_ids=torch.arange(c + 4)[None], noise_embedding=noise, target_hidden=ctx, use_cache=False)
        want = draft.compute_logits(h, model.lm_head).numpy()
    k, v = drafter.context_kv(d_params, d_cfg, jnp.asarray(ctx.numpy()), jnp.arange(c, dtype=jnp.int32)[None])
    bpos = c + jnp.arange(4, dtype=jnp.int32)[None]
    h = drafter.forward(d_params, d_cfg, module_for(cfg), params, cfg, jnp.asarray([block]), bpos, k, v, jnp.asarray([c]))
    assert rel_err(drafter.logits(d_params, d_cfg, module_for(cfg), params, cfg, h), want) < TOL


def test_same_tokens_and_verify_steps_as_zlab_dflash_generate(case, tmp_path):
    """z-lab's reference loop on the transformers target, with a steered z-lab drafter carrying the
    Gemma knobs (``input_embedding_scale`` = sqrt(H) on the raw embedding, the target's
    ``final_logit_softcapping``), gives the tokens and verify steps ours gives on the loaded
    checkpoints (the knobs restated against the family: applied once, through it)."""
    zlab = pytest.importorskip("dflash.model")
    from dflash_jax.drafter.model import load_hf_drafter
    from hf_oracle import steer_to, zlab_generate

    model, cfg, params, _ = case
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 16
    free = hf_greedy(model, prompt, n)
    dc = transformers.Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    dc.architectures, dc.num_target_layers = ["DFlashDraftModel"], cfg.num_hidden_layers
    dc.dflash_config = {"mask_token_id": V - 1, "target_layer_ids": [1, 3], "block_size": 4,
                        "input_embedding_scale": 64 ** 0.5, "final_logit_softcapping": 3.0}
    torch.manual_seed(2)
    draft = zlab.DFlashDraftModel(dc).eval()
    steer_to(draft, model, max(set(free), key=free.count), V - 1, damp=0.3)
    draft.save_pretrained(tmp_path, safe_serialization=True)
    want, accepted = zlab_generate(zlab, draft, model, prompt, n, block_size=4)
    assert max(accepted) > 1, "the steered drafter should get some blocks accepted"
    d_cfg, d_params = load_hf_drafter(tmp_path, cfg)
    assert d_cfg.input_embedding_scale == 1.0 and d_cfg.final_logit_softcapping == 0.0  # the family's, applied by it
    _draft_logits_match_zlab(zlab, draft, model, cfg, params, d_cfg, d_params, prompt[:5])
    got, steps = ours_greedy(cfg, params, prompt, n, 4, (d_cfg, d_params))
    assert got == want == free and steps == len(accepted)
    # final_logit_softcapping unset: z-lab drafts through the raw head (no cap); so do we
    dc.dflash_config = dict(dc.dflash_config, final_logit_softcapping=None)
    draft.config = dc
    draft.save_pretrained(tmp_path, safe_serialization=True)
    want, accepted = zlab_generate(zlab, draft, model, prompt, n, block_size=4)
    d_cfg, d_params = load_hf_drafter(tmp_path, cfg)
    assert d_cfg.raw_head and d_cfg.final_logit_softcapping == 0.0
    _draft_logits_match_zlab(zlab, draft, model, cfg, params, d_cfg, d_params, prompt[:5])
    got, steps = ours_greedy(cfg, params, prompt, n, 4, (d_cfg, d_params))
    assert got == want == free and steps == len(accepted)


SHARED = dict(CONF, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=0, tie_word_embeddings=False,
              final_logit_softcapping=None, attention_k_eq_v=True, num_global_key_value_heads=1)
MOE = dict(CONF, num_hidden_layers=3, layer_types=TYPES[:3], hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
           top_k_experts=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def shared_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_shared")
    model = save_tiny("Gemma4TextConfig", "Gemma4ForCausalLM", folder, seed=4, **SHARED)
    return (model, *load_hf_target(folder), folder)


@pytest.fixture(scope="module")
def moe_case(tmp_path_factory):
    """The MoE checkpoint: router drawn wide enough that no two experts nearly tie, its scale and
    per-expert scales off 1."""
    folder = tmp_path_factory.mktemp("gemma4_moe")
    model = save_tiny("Gemma4TextConfig", "Gemma4ForCausalLM", folder, seed=7, **MOE)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.router.proj.weight.normal_(0.0, 1.0, generator=gen)
            layer.router.scale.copy_(1.0 + 0.3 * torch.randn(64, generator=gen))
            layer.router.per_expert_scale.copy_(0.5 + torch.rand(4, generator=gen))
    model.save_pretrained(folder, safe_serialization=True)
    return (model, *load_hf_target(folder), folder)


def test_kv_sharing_k_eq_v_and_no_per_layer_inputs_match_transformers(shared_case):
    """``num_kv_shared_layers=2`` (layers 3 and 4 attend the keys and values of layers 2 and 1) with
    double-wide MLPs on those layers, ``attention_k_eq_v`` (Gemma 4 31B: full layer 1 has no
    ``v_proj``, its values are its key projection under the value norm) with
    ``num_global_key_value_heads=1`` against 2 on sliding layers, no per-layer inputs, untied head,
    no soft-cap: logits (one pass and chunked, captured layers) and greedy plain and DFlash decoding
    against transformers; a config without ``per_layer_config`` takes the full layers' key/value
    heads from ``num_global_key_value_heads`` under ``attention_k_eq_v`` only."""
    model, cfg, params, folder = shared_case
    assert cfg.num_kv_shared_layers == 2 and "wk" not in params["layer3"] and params["layer4"]["w_up"].shape == (64, 192)
    assert gemma4.MODEL.init_cache(cfg, 1, 8).k_sliding.shape[0] == 2 and "embed_pl" not in params and "lm_head" in params
    assert cfg.attention_k_eq_v and cfg.kv_heads == (2, 1) and "wv" not in params["layer1"] and "wv" in params["layer2"]
    check_logits_and_capture(model, cfg, params, gemma4.MODEL, (1, 3), TOL, chunk=4)
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 10
    want = hf_greedy(model, prompt, n)
    assert ours_greedy(cfg, params, prompt, n, 3)[0] == want
    assert ours_greedy(cfg, params, prompt, n, 3, tiny_drafter(cfg, seed=1, layer_ids=(1, 4), block_size=4))[0] == want
    raw = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "per_layer_config"}
    assert family_for_hf(raw).parse_hf(dict(raw, global_head_dim=16, num_global_key_value_heads=1)).kv_heads == (2, 1)
    assert family_for_hf(raw).parse_hf(dict(raw, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=False)).kv_heads == (2, 2)


def test_moe_block_matches_transformers(moe_case, tmp_path):
    """``enable_moe_block`` (Gemma 4 26B-A4B): each layer's dense MLP beside 4 routed experts (top 2),
    fused expert tensors as transformers saves them: logits (one pass and chunked, captured layers)
    and greedy plain and DFlash decoding against transformers; a missing expert tensor is refused by name."""
    import shutil

    from safetensors.numpy import load_file, save_file

    model, cfg, params, folder = moe_case
    assert cfg.num_experts == 4 and params["layer2"]["e_gate"].shape == (4, 64, 32) and params["layer0"]["e_down"].shape == (4, 32, 64)
    assert gemma4.MODEL.param_axes(cfg)["layer1"]["e_up"] == ("experts", "embed", "expert_mlp")
    check_logits_and_capture(model, cfg, params, gemma4.MODEL, (0, 1), TOL)
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 10
    want = hf_greedy(model, prompt, n)
    assert ours_greedy(cfg, params, prompt, n, 3)[0] == want
    assert ours_greedy(cfg, params, prompt, n, 3, tiny_drafter(cfg, seed=1, layer_ids=(0, 1), block_size=4))[0] == want
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.experts.down_proj"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(DFlashError, match=r"tensor model\.layers\.1\.experts\.down_proj.*missing"):
        load_hf_target(tmp_path)


def _write_gguf_from_hf(folder, path, **kv_changes) -> None:
    """A ``gemma4`` GGUF of an HF folder as llama.cpp's converter lays it out: names from ``gguf-py``'s
    own ``TensorNameMap`` (``layer_scalar`` and the fused experts as ``.weight``, the router's scale
    and per-expert scale as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale``), norms as stored (no
    +1), ``rope_freqs`` marking the full layers' unrotated pairs 1e30, sizes under its metadata keys
    (per-layer ``head_count_kv`` and ``feed_forward_length`` where they differ; ``kv_changes``:
    overrides, None drops a key). ``global_head_dim`` 16 as in :data:`CONF` (transformers folds it
    into ``per_layer_config``)."""
    import gguf
    from safetensors.numpy import load_file

    from tiny_gguf import write_gguf

    hp = json.loads((folder / "config.json").read_text())
    n, types, d_full = hp["num_hidden_layers"], hp["layer_types"], 16
    kv_full = hp["per_layer_config"][str(types.index("full_attention"))].get("num_key_value_heads", hp["num_key_value_heads"])
    name_map, out = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n), []
    for k, v in load_file(str(folder / "model.safetensors")).items():
        bid = k.split(".")[2] if k.startswith("model.layers.") else None
        if k.endswith("router.scale") or k.endswith("router.per_expert_scale"):
            name = f"blk.{bid}.ffn_gate_inp.scale" if k.endswith("router.scale") else f"blk.{bid}.ffn_down_exps.scale"
        else:
            fix = k.endswith("layer_scalar") or (".experts." in k and not k.endswith(".weight"))
            name = name_map.get_name(k + ".weight" if fix else k, try_suffixes=(".weight", ".bias"))
        out.append((name, v, None))
    rope = hp["rope_parameters"]
    n_rot = int(d_full * rope["full_attention"]["partial_rotary_factor"] / 2)
    out.append(("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (d_full // 2 - n_rot), np.float32), None))
    ffn, shared = hp["intermediate_size"], hp["num_kv_shared_layers"]
    A = "gemma4"
    kv = {f"{A}.context_length": hp["max_position_embeddings"], f"{A}.embedding_length": hp["hidden_size"], f"{A}.block_count": n,
          f"{A}.feed_forward_length": [ffn * (2 if i >= n - shared else 1) for i in range(n)] if hp["use_double_wide_mlp"] else ffn,
          f"{A}.attention.head_count": hp["num_attention_heads"],
          f"{A}.attention.head_count_kv": [hp["num_key_value_heads"] if t == "sliding_attention" else kv_full for t in types],
          f"{A}.attention.layer_norm_rms_epsilon": hp["rms_norm_eps"], f"{A}.attention.key_length": d_full,
          f"{A}.attention.value_length": d_full, f"{A}.attention.key_length_swa": hp["head_dim"],
          f"{A}.attention.value_length_swa": hp["head_dim"], f"{A}.rope.freq_base": float(rope["full_attention"]["rope_theta"]),
          f"{A}.rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]), f"{A}.rope.dimension_count": d_full,
          f"{A}.rope.dimension_count_swa": hp["head_dim"], f"{A}.attention.sliding_window": hp["sliding_window"],
          f"{A}.attention.sliding_window_pattern": [t == "sliding_attention" for t in types],
          f"{A}.attention.shared_kv_layers": shared, f"{A}.embedding_length_per_layer_input": hp["hidden_size_per_layer_input"],
          f"{A}.final_logit_softcapping": hp["final_logit_softcapping"]}
    if hp["enable_moe_block"]:
        kv.update({f"{A}.expert_count": hp["num_experts"], f"{A}.expert_used_count": hp["top_k_experts"],
                   f"{A}.expert_feed_forward_length": hp["moe_intermediate_size"]})
    kv.update(kv_changes)
    write_gguf(path, A, {k: v for k, v in kv.items() if v is not None}, out)


@pytest.mark.parametrize("which", ["case", "shared_case", "moe_case"])
def test_gguf_loads_what_safetensors_load(which, request, tmp_path):
    """A ``gemma4`` GGUF written from each checkpoint (per-layer inputs and soft-cap; KV sharing,
    double-wide MLPs, ``attention_k_eq_v`` and an untied head; the MoE block) loads to the config
    and params of the safetensors it came from and to transformers' logits; bad metadata is refused
    naming the key."""
    from dflash_jax.families.registry import load_gguf_target

    model, cfg, params, folder = request.getfixturevalue(which)
    _write_gguf_from_hf(folder, tmp_path / "m.gguf")
    g_cfg, g_params = load_gguf_target(tmp_path / "m.gguf", use_cache=False)
    assert g_cfg == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), g_params, params))
    tokens = np.random.default_rng(2).integers(0, V, (1, 9)).astype(np.int32)
    got, _, _ = _forward(g_params, g_cfg, jnp.asarray(tokens), jnp.arange(9, dtype=jnp.int32)[None], gemma4.MODEL.init_cache(g_cfg, 1, 9))
    assert rel_err(got, hf_logits(model, tokens)) < TOL
    if which != "shared_case":
        return
    for key, value in (("attention.sliding_window_pattern", None), ("attention.head_count_kv", [2, 1, 2, 2, 2]),
                       ("feed_forward_length", [96, 192, 96, 192, 192]), ("rope.dimension_count", 8)):
        _write_gguf_from_hf(folder, tmp_path / "bad.gguf", **{f"gemma4.{key}": value})
        with pytest.raises(DFlashError, match=rf"bad\.gguf: metadata gemma4\.{key}"):
            load_gguf_target(tmp_path / "bad.gguf", use_cache=False)


_MESH = """
import sys
sys.path.insert(0, "tests")
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from dflash_jax.decode import loop as decode
from dflash_jax.decode.prefill import prefill
from dflash_jax.runtime import sharding as shd
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.families.registry import family_for_hf, module_for
from dflash_jax.testing import tiny_drafter
from test_families import TINY_HF

hf = dict(TINY_HF["gemma4"], num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
          per_layer_config={"1": {"head_dim": 16}, "3": {"head_dim": 16}}, enable_moe_block=True, num_experts=4, top_k_experts=2,
          moe_intermediate_size=8)
cfg = family_for_hf(hf).parse_hf(hf, "hf")
m = module_for(cfg)
p = m.init_params(cfg, jax.random.key(3), 0.3)
dcfg, dp = tiny_drafter(cfg, seed=1, layer_ids=(0, 2))
static = Decoding(cfg, dcfg)

def run(p, mesh=None):
    st = decode.init_state(static, [[5, 9, 17, 3], [40, 2, 7]], 32, 12)
    st = st if mesh is None else shd.shard_state(st, mesh)
    return decode.decode_loop(Params(p, dp), prefill(Params(p, dp), st, static, 4), static)

a = run(p)
for mesh in (shd.make_mesh(data=2, model=2), shd.make_mesh(model=2, expert=2)):
    b = run(shd.shard_params(p, m.param_axes(cfg), mesh), mesh)
    assert (np.asarray(a.tokens) == np.asarray(b.tokens)).all() and (np.asarray(a.length) == np.asarray(b.length)).all()
print("OK")
"""



def test_gguf_with_its_gemma4_tokenizer_loads_as_a_target(case, tmp_path):
    """A ``gemma4`` GGUF carrying the ``gemma4`` tokenizer llama.cpp's converter writes (SentencePiece-
    style BPE with merges, no space prefix, control tokens ``<|turn>`` ``<turn|>``) loads as a target
    with that tokenizer: the chat prompt is one BOS and whole control tokens, the turn ends at ``<turn|>``."""
    from dflash_jax.loading import load_target

    _, cfg, params, folder = case
    words = ["\u2581", "\n"] + list("abcdehilmnorstuy") + ["hi", "\u2581hi", "mo", "de", "el", "mode", "model", "us", "er", "user"]
    merges = ["h i", "\u2581 hi", "m o", "d e", "e l", "mo de", "mode l", "u s", "e r", "us er"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|channel>", *words]
    tokens += [f"<unused{i}>" for i in range(V - len(tokens))]
    types = [3, 3, 3, 2, 3, 3, 4] + [1] * len(words) + [5] * (V - 7 - len(words))
    template = ("{{ bos_token }}{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    kv = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
          "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": template}
    _write_gguf_from_hf(folder, tmp_path / "t.gguf", **kv)
    t = load_target(tmp_path / "t.gguf")
    tid = {tok: i for i, tok in enumerate(tokens)}
    assert t.cfg == cfg and set(t.eos_ids) == {tid["<eos>"], tid["<turn|>"]}
    ids = t.tokenizer.encode_chat([{"role": "user", "content": "hi hi"}])
    assert ids == [tid[x] for x in ["<bos>", "<|turn>", "user", "\n", "hi", "\u2581hi", "<turn|>", "\n", "<|turn>", "model", "\n"]]
    assert t.tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi hi\nmodel\n"

@pytest.mark.slow
def test_a_mesh_answers_as_one_device():
    """``param_axes`` and the per-type KV cache's axes on a ``data=2, model=2`` and a ``model=2,
    expert=2`` mesh (4 CPU devices): DFlash greedy decoding with KV sharing, per-layer inputs and
    the MoE block gives one device's tokens."""
    from conftest import run_on_cpu_devices

    run_on_cpu_devices(_MESH, 4, timeout=600)


def test_conditional_generation_checkpoint_text_part(tmp_path):
    """A ``Gemma4ForConditionalGeneration`` checkpoint (nested ``text_config``, tensors under
    ``model.language_model.``, the vision tower skipped) loads as its text decoder: text-only
    logits equal transformers'."""
    text = dict(CONF, num_hidden_layers=2, layer_types=TYPES[:2])
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(5)
    model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(text_config=text, vision_config=vision,
                                                                                  audio_config=None)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path))
    cfg, params = load_hf_target(tmp_path)
    assert isinstance(cfg, Gemma4Config) and cfg.num_hidden_layers == 2 and cfg.per_layer_input == 8
    tokens = np.random.default_rng(3).integers(0, V, (1, 9)).astype(np.int32)
    got, _, _ = _forward(params, cfg, jnp.asarray(tokens), jnp.arange(9, dtype=jnp.int32)[None], gemma4.MODEL.init_cache(cfg, 1, 9))
    assert rel_err(got, hf_logits(model, tokens)) < TOL
