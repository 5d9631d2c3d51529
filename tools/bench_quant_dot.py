"""Quantized against float matrix products on this backend, as the models call them.

Times ``x [rows, in] @ W`` summed over 30 matrices (SmolLM2-135M's MLP shapes, one per layer:
``[576 in, 1536 out]``, or ``[1536 in, 576 out]`` for the K-quants, whose super-blocks of 256 do
not divide 576) in one jitted function, each weight held as:

* ``float``: gguf-py's dequantized float32 matrices ``[in, out]`` (what ``weights="float"`` holds);
* ``Q4_1``, ``Q4_K``, ``Q6_K``, ``Q8_0``, ...: the same random matrices quantized by gguf-py (the
  K-quants: random valid blocks), loaded as :func:`dflash_jax.formats.gguf_quant.quantized_tensor`
  loads a file's tensor (bit planes, nn/quant_gguf.py) and multiplied by :func:`dflash_jax.nn.quant.dot`
  (what ``weights="quantized"`` runs).

The variants run alternately, ``--repeats`` times; the median time and its ratio to float are
printed, as wall time and as this process's CPU time (``time.process_time``: both cores' work on
the product; steadier than wall time when other processes share the CPU)::

    python tools/bench_quant_dot.py --rows 1,8,64 --types Q4_1,Q4_K,Q6_K,Q8_0 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

import gguf
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from dflash_jax.formats.gguf_quant import quantized_tensor  # noqa: E402
from dflash_jax.nn import quant  # noqa: E402

OUT, IN, L = 1536, 576, 30
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _blocks(kind: str, x: np.ndarray, rng) -> np.ndarray:
    if kind in K_QUANTS:
        from tiny_gguf import kquant_bytes  # tests/tiny_gguf.py: random valid K-quant blocks
        return kquant_bytes(kind, x.shape, rng)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])


def weights(kinds, rng) -> dict:
    """``{variant: [L weights]}``; the float variant of each type is its gguf-py dequantization."""
    out = {}
    for kind in kinds:
        n_out, n_in = (IN, OUT) if kind in K_QUANTS else (OUT, IN)
        x = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        qs, fs = [], []
        for _ in range(L):
            data = _blocks(kind, x, rng)
            t = types.SimpleNamespace(name="w", tensor_type=gguf.GGMLQuantizationType[kind], shape=np.array([n_in, n_out]), data=data)
            qs.append(jax.tree_util.tree_map(jnp.asarray, quantized_tensor(t, "bench")))
            fs.append(jnp.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(n_out, n_in).T.copy()))
        out[kind], out[f"float ({kind})"] = qs, fs
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8", help="comma-separated rows of x (1: a decode step; 8: a verify pass)")
    p.add_argument("--types", default="Q4_1,Q8_0", help="comma-separated GGUF types")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    kinds = args.types.split(",")
    ws = weights(kinds, rng)
    f = jax.jit(lambda x, wl: sum(quant.dot(x, w).sum() for w in wl))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {n: jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32)) for n in (IN, OUT)}
        x_of = {name: xs[wl[0].shape[0]] for name, wl in ws.items()}
        for kind in kinds:  # compile, and check each variant computes its float twin's product
            x = x_of[kind]
            got, ref = float(f(x, ws[kind])), float(f(x, ws[f"float ({kind})"]))
            assert abs(got - ref) <= 1e-3 * max(1.0, abs(ref)), (kind, got, ref)
        times: dict = {name: [] for name in ws}
        for _ in range(args.repeats):
            for name, wl in ws.items():
                t, c = time.perf_counter(), time.process_time()
                f(x_of[name], wl).block_until_ready()
                times[name].append((time.perf_counter() - t, time.process_time() - c))
        for i, clock in enumerate(("wall", "cpu")):
            med = {n: 1000 * float(np.median([v[i] for v in vs])) for n, vs in times.items()}
            print(f"rows {rows}, {clock}: " + ", ".join(f"{k} {med[k]:.1f} ms / float {med[f'float ({k})']:.1f} ms "
                                                        f"({med[k] / med[f'float ({k})']:.2f}x)" for k in kinds), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}, {jax.devices()[0].device_kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
