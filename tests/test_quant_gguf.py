"""The GGUF block formats kept quantized (formats/gguf_quant.py -> nn/quant_gguf.py) against gguf-py's
own dequantizer (``gguf.quants.dequantize``): every type, read from a real GGUF file, dequantized
and multiplied inside jit, equals gguf-py's float32 weights within float32 rounding."""

from __future__ import annotations

import re
import types

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.formats import gguf_file
from dflash_jax.formats.gguf_quant import SUPPORTED, quantized_tensor
from dflash_jax.nn import quant
from tiny_gguf import kquant_bytes

Q = gguf.GGMLQuantizationType
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")  # gguf.quants.quantize writes these
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # gguf-py reads them only: random valid blocks
def tensor_bytes(kind: str, shape: tuple, rng) -> np.ndarray:
    """The quantized bytes of a tensor of numpy ``shape`` [*lead, out, in] (uint8 [*lead, out, row bytes])."""
    qtype = Q[kind]
    if kind in LEGACY:
        x = rng.standard_normal(shape).astype(np.float32)
        if kind == "MXFP4":
            x *= 0.1
        return gguf.quants.quantize(x, qtype)
    return kquant_bytes(kind, shape, rng)


@pytest.fixture(scope="module")
def gguf_tensors(tmp_path_factory):
    """A GGUF file holding one tensor of every supported type ([out 8, in 512]; Q4_K also stacked
    [E 3, out 4, in 256]) plus an F16 one; ``{name: ReaderTensor}`` and the path."""
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("q") / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for kind in SUPPORTED:
        w.add_tensor(kind, tensor_bytes(kind, (8, 512), rng), raw_dtype=Q[kind])
    w.add_tensor("Q4_K_stacked", tensor_bytes("Q4_K", (3, 4, 256), rng), raw_dtype=Q.Q4_K)
    w.add_tensor("F16", rng.standard_normal((8, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf_file.open_gguf(path)
    return path, gguf_file.tensor_table(reader, path)


def oracle(tensor) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)


@pytest.mark.parametrize("kind", SUPPORTED)
def test_every_type_dequantizes_as_gguf_py_inside_jit(gguf_tensors, kind):
    path, tensors = gguf_tensors
    t = tensors[kind]
    qw = quantized_tensor(t, path)
    want = oracle(t)  # [out, in]
    assert qw.shape == (512, 8) and qw.format == kind.lower()
    assert qw.nbytes <= 1.04 * t.n_bytes  # the file's bits, barely rearranged
    qw = jax.tree_util.tree_map(jnp.asarray, qw)
    got = jax.jit(quant.dequantize)(qw)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    for rows in ((3,), (1, 1)):  # several rows, and the one-row path of a decode step
        x = np.random.default_rng(1).standard_normal(rows + (512,)).astype(np.float32)
        y = jax.jit(quant.dot)(jnp.asarray(x), qw)
        np.testing.assert_allclose(np.asarray(y), x @ want.T, rtol=1e-4, atol=1e-4 * np.abs(x @ want.T).max())
    rows = jnp.array([[5, 0], [7, 7]])
    np.testing.assert_allclose(np.asarray(jax.jit(quant.take_rows)(qw, rows)), want[np.asarray(rows)], rtol=1e-6, atol=1e-6)


def test_stacked_leading_axis_and_scan_slice(gguf_tensors):
    path, tensors = gguf_tensors
    t = tensors["Q4_K_stacked"]
    qw = jax.tree_util.tree_map(jnp.asarray, quantized_tensor(t, path))
    want = oracle(t).reshape(3, 4, 256)
    assert qw.shape == (3, 256, 4)
    np.testing.assert_allclose(np.asarray(quant.dequantize(qw)), want, rtol=1e-6, atol=1e-7)
    one = jax.tree_util.tree_map(lambda a: a[1], qw)
    np.testing.assert_allclose(np.asarray(quant.dequantize(one)), want[1], rtol=1e-6, atol=1e-7)


def test_float_tensors_stay_float(gguf_tensors):
    path, tensors = gguf_tensors
    assert quantized_tensor(tensors["F16"], path) is None


def fake(name, kind, shape_ggml, data):
    return types.SimpleNamespace(name=name, tensor_type=Q[kind], shape=np.array(shape_ggml), data=data, n_bytes=data.size)


def test_wrong_size_and_unknown_type_raise():
    with pytest.raises(DFlashError, match=r"m\.gguf: tensor blk\.0\.w: Q4_K data of 143 bytes .*expected 144 bytes"):
        quantized_tensor(fake("blk.0.w", "Q4_K", [256, 1], np.zeros((1, 143), np.uint8)), "m.gguf")
    with pytest.raises(DFlashError, match=r"m\.gguf: tensor w: Q8_0 tensor of shape \[4, 48\]"):
        quantized_tensor(fake("w", "Q8_0", [48, 4], np.zeros((4, 51), np.uint8)), "m.gguf")
    with pytest.raises(DFlashError, match=r"m\.gguf: tensor w: quantization type IQ2_XXS is not supported"):
        quantized_tensor(fake("w", "IQ2_XXS", [256, 1], np.zeros((1, 66), np.uint8)), "m.gguf")


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_decode_loop_keeps_weights_quantized(gguf_tensors, monkeypatch, backend):
    """In an on-device loop, the dequantized weight is not hoisted out of the loop (XLA's
    loop-invariant code motion would otherwise carry the float weight through every step: the
    memory quantized weights save). ``gpu``: the non-CPU form of ``quant.dot``, compiled here."""
    path, tensors = gguf_tensors
    qw = jax.tree_util.tree_map(jnp.asarray, quantized_tensor(tensors["Q4_K"], path))
    monkeypatch.setattr(quant.jax, "default_backend", lambda: backend)
    step = jax.jit(lambda x, w: jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(quant.dot(x, w))[..., :512].repeat(64, -1), x))
    x = jnp.ones((1, 512), jnp.float32)
    text = step.lower(x, qw).compile().as_text()
    loops = [line.split(" while(")[0] for line in text.splitlines() if " while(" in line]
    carried = {a for line in loops for a in re.findall(r"f32\[[\d,]*\]", line)}
    assert loops and carried == {"f32[1,512]"}, carried  # x only: no float weight rides the loop


@pytest.mark.parametrize("kind,n_in", [("Q4_1", 96), ("Q5_1", 96), ("Q6_K", 768)])
def test_rows_that_do_not_split_evenly(tmp_path, kind, n_in):
    """An odd number of blocks per row (no even split into planes or runs: the general re-packing
    and a whole-row product) and three K super-blocks (runs that start inside a super-block)."""
    rng = np.random.default_rng(2)
    path = str(tmp_path / "odd.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("w", tensor_bytes(kind, (4, n_in), rng), raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf_file.tensor_table(gguf_file.open_gguf(path), path)["w"]
    qw = jax.tree_util.tree_map(jnp.asarray, quantized_tensor(t, path))
    want = oracle(t)
    np.testing.assert_allclose(np.asarray(quant.dequantize(qw)), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(quant.dot)(jnp.asarray(x), qw)), x @ want.T, rtol=1e-4, atol=1e-4 * np.abs(x @ want.T).max())


def test_a_nan_input_gives_what_the_float_product_gives(gguf_tensors):
    """quant.dot's XLA:CPU conditional (its branch for ``x[0]`` NaN) answers as the float product."""
    path, tensors = gguf_tensors
    qw = jax.tree_util.tree_map(jnp.asarray, quantized_tensor(tensors["Q4_1"], path))
    x = np.ones((1, 512), np.float32)
    x[0, 0] = np.nan
    want = x @ oracle(tensors["Q4_1"]).T
    assert np.isnan(want).all()
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.dot)(jnp.asarray(x), qw)), want)
