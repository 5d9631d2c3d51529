"""Compile time of a Qwen3.5 hybrid target's forward: its layers as one ``lax.scan`` over the
repetitions of the layer-type pattern (what :func:`dflash_jax.families.qwen3_5.model.forward_hidden` does)
against all layers unrolled (the same body with :func:`~dflash_jax.families.qwen3_5.model.period` forced to
the layer count: a scan of one step holding every layer).

The target is transformers' default ``Qwen3_5TextConfig`` (32 layers, 24 Gated DeltaNet + 8 full
attention, hidden 4096, vocab 248320: the "Qwen3.5-9B style") unless ``--layers`` changes the layer
count. Nothing is allocated: parameters and cache are abstract (``jax.ShapeDtypeStruct``), so only
tracing, lowering and XLA's compilation are timed, with the persistent compilation cache off and
the project's compiler options (:data:`dflash_jax.runtime.compiled.FRESH`). The variants alternate over
``--rounds`` rounds; each round compiles anew. Wall and CPU seconds (this process, all threads)
are reported: on a shared machine the wall time follows the load, the CPU time much less. Prints a
table; nothing is written::

    python tools/bench_compile_qwen3_5.py                  # about 1 minute on 2 cores
    python tools/bench_compile_qwen3_5.py --tokens 1 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import at_least, machine  # noqa: E402


def target_config(layers: int, dtype: str):
    """The qwen3_5 family's config of transformers' default ``Qwen3_5TextConfig`` with ``layers``
    layers (the pattern of three linear layers then a full one kept)."""
    import transformers

    from dflash_jax.families import registry

    hf = transformers.Qwen3_5TextConfig(num_hidden_layers=layers).to_dict()
    hf["architectures"] = ["Qwen3_5ForCausalLM"]
    hf["layer_types"] = [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(layers)]
    fam = next(f for f in registry.TARGET_FAMILIES if f.name == "qwen3_5")
    return fam.parse_hf(hf, "transformers.Qwen3_5TextConfig()").with_dtype(dtype)


def compile_seconds(cfg, batch: int, tokens: int, capacity: int, unrolled: bool) -> tuple[float, float, float, float]:
    """``(trace + lower, compile)`` seconds of ``qwen3_5.MODEL.forward`` over ``batch x tokens`` with a
    cache of ``capacity`` slots, wall then this process's CPU time (all its threads: what a busy
    machine does not inflate); ``unrolled``: every layer in one scan step."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.runtime import compiled as executables
    from dflash_jax.families.qwen3_5 import model as qwen3_5

    params = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(cfg.dtype)), qwen3_5.MODEL.param_shapes(cfg),
                                    is_leaf=lambda x: isinstance(x, tuple))
    cache = jax.eval_shape(lambda: qwen3_5.MODEL.init_cache(cfg, batch, capacity))
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    period = qwen3_5.period
    if unrolled:
        qwen3_5.period = lambda c: c.num_hidden_layers
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        fresh = lambda params, tokens, positions, cache: qwen3_5.MODEL.forward(params, cfg, tokens, positions, cache)  # noqa: E731
        lowered = jax.jit(fresh).lower(params, ids, ids, cache)  # a new function: nothing reused from JAX's trace caches
        t1, c1 = time.perf_counter(), time.process_time()
        lowered.compile(compiler_options=dict(executables.FRESH))
        t2, c2 = time.perf_counter(), time.process_time()
    finally:
        qwen3_5.period = period
    return t1 - t0, t2 - t1, c1 - c0, c2 - c1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=at_least(4), default=32, help="layer count, a multiple of 4 (default 32)")
    p.add_argument("--tokens", type=at_least(1), default=16, help="tokens per row of the pass (default 16: a verify block)")
    p.add_argument("--batch", type=at_least(1), default=1)
    p.add_argument("--capacity", type=at_least(1), default=1024, help="cache slots per row")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=at_least(1), default=1)
    args = p.parse_args(argv)
    if args.layers % 4:
        p.error(f"--layers: expected a multiple of 4 (the layer-type pattern), got {args.layers}")
    if args.tokens > args.capacity:
        p.error(f"--tokens {args.tokens} exceeds --capacity {args.capacity}")

    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    cfg = target_config(args.layers, args.dtype)
    times: dict[str, list[tuple[float, ...]]] = {"scan": [], "unrolled": []}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in (("scan", "unrolled") if r % 2 == 0 else ("unrolled", "scan")):
            times[name].append(compile_seconds(cfg, args.batch, args.tokens, args.capacity, name == "unrolled"))
            w_lower, w_compile, c_lower, c_compile = times[name][-1]
            print(f"round {r + 1} {name}: lower {w_lower:.2f} s (CPU {c_lower:.2f} s), compile {w_compile:.2f} s (CPU {c_compile:.2f} s)",
                  file=sys.stderr)
    m = machine()
    print(f"Machine: {m['cpu']}, {m['cores']} cores; jax {m['jax']}; {args.layers} layers ({args.layers // 4} scan steps of 4), "
          f"{args.dtype}, B x T = {args.batch} x {args.tokens}, capacity {args.capacity}; "
          f"1-minute load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("| layers run as | trace + lower: wall / CPU (median) | XLA compile: wall / CPU (median) | rounds |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = [statistics.median(t[i] for t in ts) for i in range(4)]
        print(f"| {name} | {med[0]:.2f} s / {med[2]:.2f} s | {med[1]:.2f} s / {med[3]:.2f} s | {len(ts)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
