"""Quantized against float matrix products on this backend: what the layout of the codes costs.

Times ``x [rows, 576] @ W`` summed over 30 matrices ``[1536, 576]`` (SmolLM2-135M's MLP shape, one
per layer) in one jitted function, Q4_1 weights (random, gguf-py quantized) held as:

* ``float``: the gguf-py dequantized float32 matrices ``[in, out]`` (what ``weights="float"`` holds);
* ``packed``: :mod:`dflash_jax.nn.quant_gguf`'s fields (two 4-bit codes per byte, ``[out, in/2]``,
  float16 scale and offset per 32), through :func:`dflash_jax.nn.quant.dot` (``weights="quantized"``);
* ``int8``: one code per byte ``[out, in]`` (twice the memory), same scales, same ``dot``;
* ``int8 in-out``: codes ``[in, out]`` and ``x @ W`` (the float layout);
* ``int8 mul-sum``: ``sum(x * W, -1)`` per 32-group, then over groups (a reduction instead of a dot).

Each variant runs alternately, ``--repeats`` times, the median printed::

    python tools/bench_quant_dot.py --rows 1,8 --repeats 7
"""

from __future__ import annotations

import argparse
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.nn import quant, quant_gguf  # noqa: F401  (registers the GGUF formats)
from dflash_jax.nn.quant import QuantFormat, QuantizedWeight

OUT, IN, L = 1536, 576, 30


def _int8_deq(f, dtype):
    q = f["codes"].reshape(f["codes"].shape[:-1] + (-1, 32)).astype(jnp.float32)
    w = q * f["scale"].astype(jnp.float32)[..., None] + f["offset"].astype(jnp.float32)[..., None]
    return w.reshape(w.shape[:-2] + (-1,)).astype(dtype)


quant.register(QuantFormat("bench_q4_1_int8", lambda f: f["codes"].shape[-1], _int8_deq))


def weights(rng):
    """The variants' weight lists (module docstring)."""
    x = rng.standard_normal((L, OUT, IN)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_1).reshape(L, OUT, IN // 32, 20)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    off = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    codes = blocks[..., 4:].reshape(L, OUT, -1).copy()
    c = codes.reshape(L, OUT, -1, 16)
    q8 = np.concatenate([c & 15, c >> 4], -1).reshape(L, OUT, IN).astype(np.int8)
    flt = gguf.quants.dequantize(blocks.reshape(L, OUT, -1), gguf.GGMLQuantizationType.Q4_1).reshape(L, OUT, IN)
    j = jnp.asarray
    return {
        "float": [j(flt[i].T) for i in range(L)],
        "packed": [QuantizedWeight({"codes": j(codes[i]), "scale": j(scale[i]), "offset": j(off[i])}, "q4_1") for i in range(L)],
        "int8": [QuantizedWeight({"codes": j(q8[i]), "scale": j(scale[i]), "offset": j(off[i])}, "bench_q4_1_int8") for i in range(L)],
        "int8 in-out": [{"codes": j(q8[i].T.copy()), "scale": j(scale[i].T.copy()), "offset": j(off[i].T.copy())} for i in range(L)],
        "int8 mul-sum": [QuantizedWeight({"codes": j(q8[i]), "scale": j(scale[i]), "offset": j(off[i])}, "bench_q4_1_int8")
                         for i in range(L)],
    }


def _in_out(x, f):
    q = f["codes"].reshape(-1, 32, OUT).astype(jnp.float32)
    return x @ (q * f["scale"].astype(jnp.float32)[:, None] + f["offset"].astype(jnp.float32)[:, None]).reshape(IN, OUT)


def _mul_sum(x, w):
    wq = quant.dequantize(w).reshape(1, OUT, -1, 32)
    return (x.reshape(x.shape[0], 1, -1, 32) * wq).sum(-1).sum(-1)


PRODUCTS = {"float": quant.dot, "packed": quant.dot, "int8": quant.dot, "int8 in-out": _in_out, "int8 mul-sum": _mul_sum}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8", help="comma-separated rows of x (1: a decode step; 8: a verify pass)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    ws = weights(rng)
    fns = {}
    for name, product in PRODUCTS.items():
        fns[name] = jax.jit(lambda x, wl, product=product: sum(product(x, w).sum() for w in wl))
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, IN)).astype(np.float32))
        times: dict = {name: [] for name in fns}
        ref = float(fns["float"](x, ws["float"]))
        for name, f in fns.items():
            got = float(f(x, ws[name]))  # compile, and check the variant computes the same product
            assert abs(got - ref) <= 1e-3 * max(1.0, abs(ref)), (name, got, ref)
        for _ in range(args.repeats):
            for name, f in fns.items():
                t = time.perf_counter()
                f(x, ws[name]).block_until_ready()
                times[name].append(time.perf_counter() - t)
        base = np.median(times["float"])
        print(f"rows {rows}: " + ", ".join(f"{n} {1000 * np.median(v):.1f} ms ({np.median(v) / base:.2f}x)" for n, v in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
