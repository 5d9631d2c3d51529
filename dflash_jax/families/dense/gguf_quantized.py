"""Dense GGUF targets kept quantized (``weights="quantized"``): each quantized tensor of the file becomes
a :class:`~dflash_jax.nn.quant.QuantizedWeight` (:func:`dflash_jax.formats.gguf_quant.quantized_tensor`),
read tensor by tensor from the memory-mapped file; no float copy of a quantized weight is made and
no float cache is written (the float path, :func:`dflash_jax.families.dense.gguf.load_gguf_target`,
writes ``<file>.f32``).

The tree is :mod:`dflash_jax.families.dense.model`'s, with the decoder layers per layer (a
:class:`~dflash_jax.nn.params.PerLayer`: a Q4_K_M file mixes types across layers, so its layers
need not stack; :func:`dflash_jax.loading.load_target` stacks them where they do and the layout
asks for it). A quantized matrix is held as the file stores it, rows = output features, and
stands for the model's ``[in, out]`` weight; so ``wq`` of a llama file has its rows un-permuted
(:func:`~dflash_jax.families.dense.gguf.unpermute_qk` on every field's row axis), ``lm_head`` is
``output.weight`` as stored, and a quantized ``embed`` (``token_embd``, ``V`` rows of ``H``) is also
the tied head ``[H, V]``. F32/F16/BF16 tensors (norms, biases, any float matrix) are read as the
float path reads them, in ``dtype``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import progress
from dflash_jax.families.dense import gguf as dense_gguf
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.families.dense.model import MODEL
from dflash_jax.formats.gguf_file import dequantize_tensor, open_gguf, release_pages
from dflash_jax.formats.gguf_quant import quantized_tensor
from dflash_jax.nn.params import PerLayer
from dflash_jax.nn.quant import QuantizedWeight


def load_quantized_gguf_target(path: str | os.PathLike, dtype: str = "float32", *, as_numpy: bool = False) -> tuple[TargetConfig, dict]:
    """A dense GGUF target (``llama``, ``qwen2``, ``qwen3``) with its quantized tensors kept quantized.

    Args:
      path: the ``.gguf`` file.
      dtype: the compute dtype (``cfg.dtype``, every ``QuantizedWeight.dtype``, float leaves).
      as_numpy: numpy leaves (fields) instead of JAX arrays; otherwise each tensor is moved to the
        default device as it is read, so the host holds one tensor's conversion at a time.
    Returns:
      ``(cfg, params)``: ``params["layers"]`` a :class:`~dflash_jax.nn.params.PerLayer`; weights of
      a quantized type are :class:`~dflash_jax.nn.quant.QuantizedWeight`, the rest float in ``dtype``.
    Raises:
      DFlashError: as :func:`dflash_jax.families.dense.gguf.load_gguf_target`, and for a tensor of a
        type :mod:`dflash_jax.formats.gguf_quant` does not keep or whose bytes do not fit its shape.
    """
    path = str(path)
    reader = open_gguf(path)
    cfg, tensors = dense_gguf.gguf_config(reader, path, str(dtype))
    dense_gguf.check_tensors(cfg, tensors, path)
    np_dtype = np.dtype(jnp.dtype(dtype))
    put = (lambda a: a) if as_numpy else jnp.asarray

    def weight(name: str, want: tuple, rows_of=None, transpose: bool = True):
        """Tensor ``name`` of numpy shape ``want`` (``[out, in]`` for a matrix): a QuantizedWeight
        (rows permuted by ``rows_of``), or the float array (a matrix transposed unless told not)."""
        t = dense_gguf.checked(tensors, name, want, path)
        qw = quantized_tensor(t, path, str(dtype))
        if qw is None:
            x = dequantize_tensor(t, path)
            x = x if rows_of is None else rows_of(x)
            out = put(np.asarray(x.T if x.ndim == 2 and transpose else x, np_dtype))
        else:
            fields = qw.fields if rows_of is None else {k: np.ascontiguousarray(rows_of(a)) for k, a in qw.fields.items()}
            out = QuantizedWeight(fields={k: put(a) for k, a in fields.items()}, format=qw.format, dtype=qw.dtype)
        release_pages(reader, t)  # its bytes are converted (copies): out of the resident set
        return out

    shapes = MODEL.param_shapes(cfg)
    H, V = cfg.hidden_size, cfg.vocab_size
    name = os.path.basename(path)
    with progress.step(f"reading {name} (quantized weights kept quantized)", f"read {name}", routine=True):
        params: dict = {"embed": weight("token_embd.weight", (V, H), transpose=False),  # float: [V, H]
                        "norm": weight("output_norm.weight", (H,))}
        if "lm_head" in shapes:
            params["lm_head"] = weight("output.weight", (V, H))
        params["layers"] = PerLayer(_layer(cfg, shapes["layers"], i, weight) for i in range(cfg.num_hidden_layers))
    return cfg, params


def _layer(cfg: TargetConfig, layer_shapes: dict, i: int, weight) -> dict:
    """Layer ``i``'s leaves, each read by ``weight(name, numpy shape, rows_of)``."""
    out = {}
    for key, full in layer_shapes.items():
        want = full[1:]
        if key in dense_gguf._MATRICES:
            want = (want[1], want[0])  # stored [out, in]
        heads = None
        if cfg.family == "llama" and key in ("wq", "bq"):
            heads = cfg.num_attention_heads
        elif cfg.family == "llama" and key in ("wk", "bk"):
            heads = cfg.num_key_value_heads
        rows_of = None if heads is None else (lambda a, n=heads: dense_gguf.unpermute_qk(a, n))
        out[key] = weight(f"blk.{i}.{dense_gguf._PARAM_TO_GGUF[key]}", want, rows_of)
    return out


def quantized_nbytes(params) -> int:
    """Bytes of every leaf of ``params`` (quantized fields and float arrays alike)."""
    return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(params))
