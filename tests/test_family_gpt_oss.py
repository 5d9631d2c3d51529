"""The gpt_oss family against transformers' ``GptOssForCausalLM`` (tiny random checkpoint saved by
transformers 5, float32, CPU): logits (one pass, chunked prefill plus decode, captured layers) with
attention sinks, alternating sliding (window 5) and full layers, YaRN, biased router and experts and
a clamped SwiGLU whose clamp is reached; greedy plain and DFlash decoding (chains and trees) for one
and several prefill chunks; MXFP4 expert tensors dequantized as transformers' ``mxfp4`` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax.families.gpt_oss.config import GptOssConfig  # noqa: E402
from dflash_jax.families.gpt_oss.safetensors import dequantize_mxfp4  # noqa: E402
from dflash_jax.families.gpt_oss import model as gpt_oss  # noqa: E402
from dflash_jax.families.registry import load_hf_target  # noqa: E402
from dflash_jax.testing import tiny_drafter  # noqa: E402
from hf_oracle import check_logits_and_capture, rel_err, hf_greedy, hf_logits, ours_greedy, save_tiny  # noqa: E402

V, TOL = 96, 1e-4
CONF = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.6, rms_norm_eps=1e-5,
            initializer_range=0.1, max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 16, "rope_theta": 150000.0})
_forward = jax.jit(gpt_oss.MODEL.forward, static_argnums=1)




@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = save_tiny("GptOssConfig", "GptOssForCausalLM", folder, seed=4, **CONF)
    cfg, params = load_hf_target(folder)
    return model, cfg, params, folder


def test_logits_and_capture_match_transformers(target):
    model, cfg, params, _ = target
    assert isinstance(cfg, GptOssConfig) and cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.rope.kind == "yarn"
    check_logits_and_capture(model, cfg, params, gpt_oss.MODEL, (0, 2), TOL)


def test_the_pieces_matter(target):
    """Guards against passing vacuously: without the sinks, the window or the clamp the logits differ."""
    import dataclasses

    model, cfg, params, _ = target
    tokens = np.random.default_rng(8).integers(0, V, (1, 14)).astype(np.int32)
    want = hf_logits(model, tokens)
    pos = jnp.arange(14, dtype=jnp.int32)[None]
    no_sinks = {k: dict(v, sinks=jnp.full_like(v["sinks"], -1e9)) if isinstance(v, dict) else v for k, v in params.items()}
    for p, c in ((no_sinks, cfg), (params, dataclasses.replace(cfg, sliding_window=0)), (params, dataclasses.replace(cfg, swiglu_limit=1e9))):
        got, _, _ = _forward(p, c, jnp.asarray(tokens), pos, gpt_oss.MODEL.init_cache(c, 1, 14))
        assert rel_err(got, want) > 1e-3


@pytest.mark.parametrize("chunk", [32, 3])
def test_greedy_plain_and_dflash_match_transformers(target, chunk):
    model, cfg, params, _ = target
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 12
    want = hf_greedy(model, prompt, n)
    assert ours_greedy(cfg, params, prompt, n, chunk)[0] == want
    drafter = tiny_drafter(cfg, seed=1, layer_ids=(0, 2), block_size=4)
    assert ours_greedy(cfg, params, prompt, n, chunk, drafter)[0] == want
    if chunk == 3:
        assert ours_greedy(cfg, params, prompt, n, chunk, drafter, tree=3)[0] == want


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rs = np.random.RandomState(0)
    blocks = rs.randint(0, 256, (3, 8, 2, 16)).astype(np.uint8)
    scales = rs.randint(120, 134, (3, 8, 2)).astype(np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    np.testing.assert_array_equal(np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2), want)


def test_mxfp4_checkpoint_loads(target, tmp_path):
    """A checkpoint whose experts are MXFP4 blocks and scales (the published layout) loads to the
    params of the same weights stored dequantized, and gives transformers' logits for them."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    import copy

    model, cfg, _, folder = target
    model = copy.deepcopy(model)  # the fixture's model stays as saved
    tensors = load_file(str(folder / "model.safetensors"))
    rs = np.random.RandomState(1)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            pre = f"model.layers.{i}.mlp.experts."
            for proj, (n_in, n_out) in (("gate_up_proj", (H, 2 * I)), ("down_proj", (I, H))):
                blocks = rs.randint(0, 256, (E, n_out, n_in // 32, 16)).astype(np.uint8)
                scales = rs.randint(118, 124, (E, n_out, n_in // 32)).astype(np.uint8)
                w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
                getattr(layer.mlp.experts, proj).copy_(w)
                del tensors[pre + proj]
                tensors[pre + proj + "_blocks"], tensors[pre + proj + "_scales"] = blocks, scales
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    q_cfg, q_params = load_hf_target(tmp_path)
    tokens = np.random.default_rng(3).integers(0, V, (1, 10)).astype(np.int32)
    got, _, _ = _forward(q_params, q_cfg, jnp.asarray(tokens), jnp.arange(10, dtype=jnp.int32)[None], gpt_oss.MODEL.init_cache(q_cfg, 1, 10))
    assert rel_err(got, hf_logits(model, tokens)) < TOL


def test_same_tokens_and_verify_steps_as_zlab_dflash_generate(target, tmp_path):
    """z-lab's reference loop on the transformers target and a steered drafter (blocks accepted)
    gives the tokens and verify steps ours gives on the loaded checkpoints."""
    zlab = pytest.importorskip("dflash.model")
    from hf_oracle import zlab_matches_ours

    model, cfg, params, _ = target
    zlab_matches_ours(zlab, model, cfg, params, tmp_path, [3, 17, 42, 8, 11, 5, 29], 24, V, 64)


def _write_gguf_from_hf(folder, path, conf: dict, tokenizer_kv: dict | None = None, **kv_changes) -> None:
    """A ``gpt-oss`` GGUF of an HF folder (dequantized experts) as llama.cpp's converter lays it
    out: names from ``gguf-py``'s own ``TensorNameMap``, ``gate_up_proj`` split into its even (gate)
    and odd (up) columns, experts stacked ``[E, out, in]`` and quantized to MXFP4 by
    ``gguf.quants.quantize``, sizes under llama.cpp's metadata keys (``kv_changes``: overrides,
    ``None`` drops a key; ``tokenizer_kv``: ``tokenizer.ggml.*`` keys)."""
    import gguf
    from safetensors.numpy import load_file

    from tiny_gguf import write_gguf

    tensors, n, A = load_file(str(folder / "model.safetensors")), conf["num_hidden_layers"], "gpt-oss"
    for i in range(n):
        ex = f"model.layers.{i}.mlp.experts."
        gate_up, gate_up_b = tensors.pop(ex + "gate_up_proj"), tensors.pop(ex + "gate_up_proj_bias")
        tensors[ex + "gate_proj.weight"], tensors[ex + "up_proj.weight"] = (np.swapaxes(gate_up[..., s::2], 1, 2) for s in (0, 1))
        tensors[ex + "gate_proj.bias"], tensors[ex + "up_proj.bias"] = gate_up_b[:, 0::2], gate_up_b[:, 1::2]
        tensors[ex + "down_proj.weight"] = np.swapaxes(tensors.pop(ex + "down_proj"), 1, 2)
        tensors[ex + "down_proj.bias"] = tensors.pop(ex + "down_proj_bias")
    name_map, out = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, n), []
    for k, v in tensors.items():
        name = name_map.get_name(k, try_suffixes=(".weight", ".bias"))
        name = name + ".weight" if name.endswith("attn_sinks") else name
        out.append((name, v, gguf.GGMLQuantizationType.MXFP4 if name.endswith("_exps.weight") else None))
    rope = conf["rope_parameters"]
    kv = {f"{A}.embedding_length": conf["hidden_size"], f"{A}.block_count": n, f"{A}.feed_forward_length": conf["intermediate_size"],
          f"{A}.attention.head_count": conf["num_attention_heads"], f"{A}.attention.head_count_kv": conf["num_key_value_heads"],
          f"{A}.attention.key_length": conf["head_dim"], f"{A}.attention.value_length": conf["head_dim"],
          f"{A}.attention.layer_norm_rms_epsilon": conf["rms_norm_eps"], f"{A}.rope.freq_base": rope["rope_theta"],
          f"{A}.context_length": conf["max_position_embeddings"], f"{A}.expert_count": conf["num_local_experts"],
          f"{A}.expert_used_count": conf["num_experts_per_tok"], f"{A}.expert_feed_forward_length": conf["intermediate_size"],
          f"{A}.attention.sliding_window": conf["sliding_window"], f"{A}.rope.scaling.type": "yarn",
          f"{A}.rope.scaling.factor": rope["factor"], f"{A}.rope.scaling.original_context_length": rope["original_max_position_embeddings"]}
    kv.update({f"{A}.{k}": v for k, v in kv_changes.items()})
    kv.update(tokenizer_kv or {})
    write_gguf(path, A, {k: v for k, v in kv.items() if v is not None}, out)


def test_gguf_loads_what_safetensors_load(tmp_path):
    """A ``gpt-oss`` GGUF with MXFP4 experts (what llama.cpp's graph runs: SwiGLU limit 7, YaRN
    truncated) loads to the params of the safetensors it came from (expert weights MXFP4 stores
    exactly) and to transformers' logits; bad metadata is refused naming the key."""
    import gguf

    from dflash_jax.errors import DFlashError
    from dflash_jax.families.registry import load_gguf_target

    conf = dict(CONF, swiglu_limit=7.0, rope_parameters=dict(CONF["rope_parameters"], truncate=True))
    save_tiny("GptOssConfig", "GptOssForCausalLM", tmp_path / "hf", seed=6, **conf)
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    rs = np.random.RandomState(2)
    with torch.no_grad():  # expert weights on the MXFP4 grid, so quantizing them to MXFP4 is exact
        for layer in model.model.layers:
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(layer.mlp.experts, proj)
                E, n_in, n_out = w.shape
                blocks, scales = rs.randint(0, 256, (E, n_out, n_in // 32, 16)), rs.randint(118, 124, (E, n_out, n_in // 32))
                w.copy_(torch.from_numpy(np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2)))
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg, params = load_hf_target(tmp_path / "hf")
    _write_gguf_from_hf(tmp_path / "hf", tmp_path / "m.gguf", conf)
    g_cfg, g_params = load_gguf_target(tmp_path / "m.gguf", use_cache=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.3.ffn_down_exps.weight"] == "MXFP4"
    assert g_cfg == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: a.dtype == b.dtype and bool((a == b).all()), g_params, params))
    tokens = np.random.default_rng(2).integers(0, V, (1, 9)).astype(np.int32)
    got, _, _ = _forward(g_params, g_cfg, jnp.asarray(tokens), jnp.arange(9, dtype=jnp.int32)[None], gpt_oss.MODEL.init_cache(g_cfg, 1, 9))
    assert rel_err(got, hf_logits(model, tokens)) < TOL
    for change, key in (({"attention.sliding_window": None}, "attention.sliding_window"),
                        ({"rope.scaling.type": "linear"}, "rope.scaling.type"), ({"expert_count": None}, "expert_count")):
        _write_gguf_from_hf(tmp_path / "hf", tmp_path / "bad.gguf", conf, **change)
        with pytest.raises(DFlashError, match=rf"bad\.gguf: metadata gpt-oss\.{key}"):
            load_gguf_target(tmp_path / "bad.gguf", use_cache=False)


def test_gguf_mxfp4_blocks_are_transformers_mxfp4():
    """ggml's MXFP4 block (scale byte, then 16 bytes: low nibbles values 0..15, high 16..31) read by
    ``gguf.quants.dequantize`` equals transformers' MXFP4 blocks repacked the way llama.cpp's
    converter does (HF: value 2j in byte j's low nibble, 2j+1 in its high nibble)."""
    import gguf

    rs = np.random.RandomState(3)
    blocks, scales = rs.randint(0, 256, (3, 8, 2, 16)).astype(np.uint8), rs.randint(0, 256, (3, 8, 2)).astype(np.uint8)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(3, 8, 2, 32)
    packed = np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1).reshape(3 * 8, 2 * 17)
    got = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4).reshape(3, 8, 64)
    np.testing.assert_array_equal(got, dequantize_mxfp4(blocks, scales))


def _harmony_tokenizer_kv(specials: dict) -> dict:
    """``tokenizer.ggml.*`` keys of a ``V``-token vocabulary: ``specials`` (``{text: id}``) are CONTROL
    tokens, the others plain ``w<id>``; EOS is ``<|return|>`` (as in gpt-oss GGUFs), else id 0."""
    names = {i: t for t, i in specials.items()}
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": [names.get(i, f"w{i}") for i in range(V)],
            "tokenizer.ggml.token_type": [3 if i in names else 1 for i in range(V)],
            "tokenizer.ggml.eos_token_id": specials.get("<|return|>", 0)}


def test_gguf_chat_turn_ends_at_call_not_at_end(target, tmp_path):
    """A gpt-oss GGUF (EOS ``<|return|>``, harmony's control tokens) loaded as a target ends a greedy
    decode at ``<|call|>`` and goes on past ``<|end|>``, which ends one message of a harmony turn, not
    the turn: the tokens sit at ids the model emits greedily (found first without stops; ``-1`` pads
    the stop list to the same width, so both decodes run one compiled program)."""
    from dflash_jax.decode import loop as decode
    from dflash_jax.decode.state import Decoding, Params
    from dflash_jax.loading import load_target

    _, _, _, folder = target
    prompt = [3, 17, 42, 8, 11, 5]

    def greedy(t, stops):
        static, params = Decoding(t.cfg, None), Params(t.params, None)
        st = decode.init_state(static, [prompt], 32, 12, stops)
        st = decode.decode_loop(params, decode.prefill(params, st, static, 8), static)
        return [int(i) for i in np.asarray(st.tokens[0, len(prompt): int(st.length[0])])]

    _write_gguf_from_hf(folder, tmp_path / "plain.gguf", CONF, _harmony_tokenizer_kv({}))
    free_run = greedy(load_target(tmp_path / "plain.gguf"), [-1, -1, -1])
    j = next(k for k in range(1, len(free_run)) if free_run[k] not in free_run[:k])  # free_run[0] (<|end|>) came before
    free = [i for i in range(V) if i not in free_run[: j + 1]]
    specials = {"<|end|>": free_run[0], "<|call|>": free_run[j], "<|return|>": free[0], "<|endoftext|>": free[1], "<|start|>": free[2]}
    _write_gguf_from_hf(folder, tmp_path / "harmony.gguf", CONF, _harmony_tokenizer_kv(specials))
    t = load_target(tmp_path / "harmony.gguf")
    assert set(t.eos_ids) == {free[0], free[1], free_run[j]}
    assert greedy(t, list(t.eos_ids)) == free_run[: j + 1]
