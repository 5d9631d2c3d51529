"""HF safetensors loading: sharded and half-precision checkpoints, and every bad-input error."""

from __future__ import annotations

import json
import os
import shutil
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from dflash_jax.errors import DFlashError  # noqa: E402
from dflash_jax.formats.checkpoint import INDEX_FILE, SINGLE_FILE, read_safetensors_header
from dflash_jax.families.dense.safetensors import load_hf_target  # noqa: E402

_QWEN2 = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.1)


def _build(kind: str = "qwen2", **over):
    torch.manual_seed(0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**_QWEN2, **over}))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_QWEN2, "tie_word_embeddings": True, **over}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def _expected(model, qkv_bias: bool) -> dict:
    """The dense pytree written out by hand from the torch state dict (float32 numpy)."""
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    L = model.config.num_hidden_layers

    def stack(suffix, t=False):
        return np.stack([sd[f"model.layers.{i}.{suffix}"].T if t else sd[f"model.layers.{i}.{suffix}"] for i in range(L)])

    layers = {"attn_norm": stack("input_layernorm.weight"), "mlp_norm": stack("post_attention_layernorm.weight"),
              "wq": stack("self_attn.q_proj.weight", True), "wk": stack("self_attn.k_proj.weight", True),
              "wv": stack("self_attn.v_proj.weight", True), "wo": stack("self_attn.o_proj.weight", True),
              "w_gate": stack("mlp.gate_proj.weight", True), "w_up": stack("mlp.up_proj.weight", True),
              "w_down": stack("mlp.down_proj.weight", True)}
    if qkv_bias:
        layers.update(bq=stack("self_attn.q_proj.bias"), bk=stack("self_attn.k_proj.bias"), bv=stack("self_attn.v_proj.bias"))
    out = {"embed": sd["model.embed_tokens.weight"], "layers": layers, "norm": sd["model.norm.weight"]}
    if not model.config.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    return out


def _assert_tree_equal(params, want, dtype=np.float32):
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(want)
    for got, exp in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
        got = np.asarray(got)
        assert got.dtype == dtype and got.shape == exp.shape
        np.testing.assert_array_equal(got.astype(np.float32), np.asarray(exp, np.float32))


@pytest.fixture(scope="module")
def model():
    return _build()


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="8KB")
    return folder


@pytest.fixture
def copy(tmp_path):
    def make(src):
        dst = tmp_path / "ckpt"
        shutil.copytree(src, dst)
        return dst

    return make


def _rewrite(folder, edit, name=SINGLE_FILE):
    path = os.path.join(folder, name)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _raises(folder, *needles, dtype="float32"):
    with pytest.raises(DFlashError) as e:
        load_hf_target(folder, dtype=dtype)
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


# ---- good checkpoints --------------------------------------------------------------------------


def test_single_file_matches_state_dict(model, saved):
    cfg, params = load_hf_target(saved)
    assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.dtype == "float32"
    _assert_tree_equal(params, _expected(model, qkv_bias=True))


def test_sharded_checkpoint(model, saved, sharded):
    index = json.load(open(os.path.join(sharded, INDEX_FILE)))
    assert len(set(index["weight_map"].values())) > 2 and not os.path.exists(os.path.join(sharded, SINGLE_FILE))
    cfg, params = load_hf_target(sharded)
    _assert_tree_equal(params, _expected(model, qkv_bias=True))
    assert cfg == load_hf_target(saved)[0]


@pytest.mark.parametrize("torch_dtype,code", [("bfloat16", "BF16"), ("float16", "F16")])
def test_half_precision_checkpoints(tmp_path, torch_dtype, code):
    model = _build().to(getattr(torch, torch_dtype))
    model.save_pretrained(tmp_path, safe_serialization=True)
    header = read_safetensors_header(tmp_path / SINGLE_FILE)
    assert {info.dtype for info in header.values()} == {code}
    want = _expected(model, qkv_bias=True)  # exact upcast of the stored half-precision values
    _, params = load_hf_target(tmp_path, dtype="float32")
    _assert_tree_equal(params, want)
    cfg, params = load_hf_target(tmp_path, dtype=torch_dtype)
    assert cfg.dtype == torch_dtype
    np_dtype = ml_dtypes.bfloat16 if torch_dtype == "bfloat16" else np.float16
    _assert_tree_equal(params, want, dtype=np.dtype(np_dtype))


def test_fp32_checkpoint_to_bf16_rounds(model, saved):
    _, params = load_hf_target(saved, dtype="bfloat16")
    want = _expected(model, qkv_bias=True)
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"]), want["layers"]["wq"].astype(ml_dtypes.bfloat16))


def test_tied_llama_tolerates_lm_head_copy_and_inv_freq(tmp_path):
    model = _build("llama")
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, params = load_hf_target(tmp_path)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    _assert_tree_equal(params, _expected(model, qkv_bias=False))

    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
        t["model.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    _rewrite(tmp_path, add)
    _assert_tree_equal(load_hf_target(tmp_path)[1], _expected(model, qkv_bias=False))


# ---- bad tensors -------------------------------------------------------------------------------


def test_missing_tensor(saved, copy):
    folder = copy(saved)
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _raises(folder, SINGLE_FILE, "model.layers.1.mlp.up_proj.weight", "missing")


def test_missing_bias_for_qwen2(saved, copy):
    folder = copy(saved)
    _rewrite(folder, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    _raises(folder, SINGLE_FILE, "model.layers.0.self_attn.k_proj.bias", "missing")


def test_unexpected_tensor(saved, copy):
    folder = copy(saved)
    _rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros((2, 2), np.float32)}))
    _raises(folder, SINGLE_FILE, "model.layers.0.self_attn.extra.weight", "unexpected")


def test_misshaped_tensor(saved, copy):
    folder = copy(saved)
    name = "model.layers.1.self_attn.q_proj.weight"
    _rewrite(folder, lambda t: t.update({name: np.ascontiguousarray(t[name][:, :-1])}))
    _raises(folder, SINGLE_FILE, name, "shape (32, 31)", "(32, 32)")


def test_unsupported_dtype(saved, copy):
    folder = copy(saved)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(folder, lambda t: t.update({name: t[name].astype(np.int32)}))
    _raises(folder, SINGLE_FILE, name, "unsupported dtype I32")


def test_truncated_file(saved, copy):
    folder = copy(saved)
    path = os.path.join(folder, SINGLE_FILE)
    header = read_safetensors_header(path)
    last = max(header, key=lambda n: header[n].end)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    _raises(folder, SINGLE_FILE, last, "truncated")


def test_truncated_header(saved, copy):
    folder = copy(saved)
    path = os.path.join(folder, SINGLE_FILE)
    with open(path, "r+b") as f:
        f.truncate(40)
    _raises(folder, SINGLE_FILE, "header length")
    with open(path, "r+b") as f:
        f.truncate(5)
    _raises(folder, SINGLE_FILE, "truncated")


def test_corrupt_header(saved, copy):
    folder = copy(saved)
    path = os.path.join(folder, SINGLE_FILE)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\x00garbage")
    _raises(folder, SINGLE_FILE, "corrupt header")
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 60))
    _raises(folder, SINGLE_FILE, "corrupt or truncated")


def test_header_offsets_disagree_with_shape(saved, copy):
    folder = copy(saved)
    path = os.path.join(folder, SINGLE_FILE)
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = "model.norm.weight"
    header[name]["shape"] = [header[name]["shape"][0] * 2]
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    raw += b" " * (n - len(raw))  # same length keeps every offset valid
    with open(path, "wb") as f:
        f.write(data[:8] + raw + data[8 + n :])
    _raises(folder, SINGLE_FILE, name, "data_offsets")


# ---- sharded checkpoints -----------------------------------------------------------------------


def test_index_points_to_missing_shard(sharded, copy):
    folder = copy(sharded)
    weight_map = json.load(open(os.path.join(folder, INDEX_FILE)))["weight_map"]
    name, shard = sorted(weight_map.items(), key=lambda kv: (kv[1], kv[0]))[-1]
    others = [n for n, s in weight_map.items() if s == shard]
    os.remove(os.path.join(folder, shard))
    msg = _raises(folder, INDEX_FILE, shard, "not found")
    assert any(n in msg for n in others)


def test_index_names_wrong_shard(sharded, copy):
    folder = copy(sharded)
    index_path = os.path.join(folder, INDEX_FILE)
    index = json.load(open(index_path))
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    json.dump(index, open(index_path, "w"))
    _raises(folder, shards[1], name, "not in this shard")


def test_missing_tensor_in_sharded(sharded, copy):
    folder = copy(sharded)
    index_path = os.path.join(folder, INDEX_FILE)
    index = json.load(open(index_path))
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = index["weight_map"].pop(name)
    json.dump(index, open(index_path, "w"))
    _rewrite(folder, lambda t: t.pop(name), name=shard)
    _raises(folder, INDEX_FILE, name, "missing")


def test_truncated_shard(sharded, copy):
    folder = copy(sharded)
    shard = sorted(set(json.load(open(os.path.join(folder, INDEX_FILE)))["weight_map"].values()))[0]
    path = os.path.join(folder, shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    _raises(folder, shard, "tensor", "truncated")


def test_malformed_index(sharded, copy):
    folder = copy(sharded)
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}}, f)
    _raises(folder, INDEX_FILE, "weight_map")


def test_no_weights(saved, copy):
    folder = copy(saved)
    os.remove(os.path.join(folder, SINGLE_FILE))
    _raises(folder, SINGLE_FILE, INDEX_FILE)


# ---- config and options ------------------------------------------------------------------------


def _edit_config(folder, edit):
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))


def test_config_missing_hidden_size(saved, copy):
    folder = copy(saved)
    _edit_config(folder, lambda c: c.pop("hidden_size"))
    _raises(folder, "config.json", "hidden_size", "missing")


def test_config_unknown_architecture(saved, copy):
    folder = copy(saved)

    def edit(c):
        c["architectures"], c["model_type"] = ["GPT2LMHeadModel"], "gpt2"

    _edit_config(folder, edit)
    _raises(folder, "config.json", "architectures", "GPT2LMHeadModel")


def test_config_missing(saved, copy):
    folder = copy(saved)
    os.remove(os.path.join(folder, "config.json"))
    _raises(folder, "config.json", "not found")


def test_config_disagrees_with_weights(saved, copy):
    folder = copy(saved)
    _edit_config(folder, lambda c: c.update(intermediate_size=40))
    _raises(folder, SINGLE_FILE, "mlp.gate_proj.weight", "shape (48, 32)", "(40, 32)")


def test_unsupported_dtype_option(saved):
    _raises(saved, "dtype", "int8", dtype="int8")
