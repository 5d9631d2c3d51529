"""A target pass's first call in a process against its later calls, with and without XLA:CPU's
YNNPACK fusions (the evidence for :data:`dflash_jax.decode.prefill.FEW_ROWS_OPTIONS`).

The loaded default target's :func:`dflash_jax.families.dense.model.forward` over ``B x T`` tokens (a
donated KV cache of 1024 slots) is compiled twice per shape, with XLA's defaults and with
``FEW_ROWS_OPTIONS``; each program's first call is timed, then the median of ``--calls`` later
calls, the variants alternating over ``--rounds`` rounds (the first call counts once: later
rounds reuse the program). Prints a table; nothing is written::

    python tools/bench_first_call.py                         # about 2 minutes on 2 cores
    python tools/bench_first_call.py --shapes 1x64,1x256 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1,1x2,1x8,8x1,8x2,1x64,1x256", help="comma-separated BxT passes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from dflash_jax.runtime import compiled as executables
    from dflash_jax.loading import load_target
    from dflash_jax.families.dense import model as dense
    from dflash_jax.decode.prefill import FEW_ROWS_OPTIONS

    target = load_target()
    cfg, params = target.cfg, target.params

    def fwd(params, tokens, positions, cache):
        logits, cache, _ = dense.MODEL.forward(params, cfg, tokens, positions, cache)
        return logits[:, -1], cache

    variants = {"YNN (default)": {}, "without YNN": FEW_ROWS_OPTIONS}
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    progs, first, later, caches = {}, {}, {}, {}
    for b, t in shapes:
        tokens = jnp.ones((b, t), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(300, 300 + t, dtype=jnp.int32), (b, t))
        for name, options in variants.items():
            c = jax.jit(fwd, donate_argnums=3).lower(params, tokens, positions, dense.MODEL.init_cache(cfg, b, 1024)).compile(
                compiler_options={**executables.FRESH, **options})  # as the project compiles
            progs[(b, t, name)] = (c, tokens, positions)
    for _ in range(args.rounds):
        for k, (c, tokens, positions) in progs.items():
            cache = caches.pop(k, None) or dense.MODEL.init_cache(cfg, k[0], 1024)
            s = time.perf_counter()
            out, cache = c(params, tokens, positions, cache)
            out.block_until_ready()
            first.setdefault(k, time.perf_counter() - s)
            times = []
            for _ in range(args.calls):
                s = time.perf_counter()
                out, cache = c(params, tokens, positions, cache)
                out.block_until_ready()
                times.append(time.perf_counter() - s)
            caches[k] = cache
            later.setdefault(k, []).append(statistics.median(times))
    m = machine()
    print(f"Machine: {m['cpu']}, {m['cores']} cores; jax {jax.__version__}; default target, float32\n")
    print("| B x T | " + " | ".join(f"{n}: first call | {n}: later (median)" for n in variants) + " |")
    print("|---|" + "---|---|" * len(variants))
    for b, t in shapes:
        cells = [f"{1000 * first[(b, t, n)]:.0f} ms | {1000 * statistics.median(later[(b, t, n)]):.1f} ms" for n in variants]
        print(f"| {b} x {t} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
