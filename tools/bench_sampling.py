"""What a sampled token costs: ``dflash_jax.decode.sampling.sample_at`` (inverse transform, one uniform
per token) against a Gumbel-max draw (``V`` random numbers per token, the alternative it replaced)
and the greedy argmax, at the shapes of a plain step (``T = 1``) and a verify of 8 slots, on the
default target's vocabulary.

Each variant is jitted and compiled first; then rounds alternate the variants (the machine is
shared), and the section reports the median milliseconds per call and the ratio to the argmax.

    python tools/bench_sampling.py                  # writes its section of BENCHMARKS.md
    python tools/bench_sampling.py --no-write --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import time

import benchlib
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode.sampling import SamplingConfig, row_keys, sample_at, warp_logits

SHAPES = ((1, 1), (8, 1), (1, 8), (4, 8), (8, 8))  # (rows B, slots T)


def gumbel_max(rng, index, logits, cfg):
    """The Gumbel-max draw with the noise of each position: ``argmax(warp(logits) + g)``."""
    def noise(key, t):
        return jax.random.gumbel(jax.random.fold_in(key, t), (logits.shape[-1],), jnp.float32)

    g = jax.vmap(jax.vmap(noise, (None, 0)), (0, 0))(rng, index.astype(jnp.uint32))
    return jnp.argmax(warp_logits(logits, cfg) + g, axis=-1)


def variants(top_p: float):
    cfg = SamplingConfig(1.0, top_p=top_p)
    return {"inverse transform (sample_at)": jax.jit(lambda r, i, lg: sample_at(r, i, lg, cfg)),
            "Gumbel-max": jax.jit(lambda r, i, lg: gumbel_max(r, i, lg, cfg)),
            "argmax (greedy)": jax.jit(lambda r, i, lg: jnp.argmax(lg, axis=-1))}


def measure(vocab: int, rounds: int, top_p: float) -> list[tuple]:
    """``[(B, T, {variant: median ms})]``."""
    out = []
    for b, t in SHAPES:
        rng, index = row_keys(0, b), jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
        logits = jax.random.normal(jax.random.key(1), (b, t, vocab), jnp.float32) * 3
        fns = variants(top_p)
        for f in fns.values():
            f(rng, index, logits).block_until_ready()
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(rng, index, logits).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        out.append((b, t, {k: 1e3 * float(np.median(v)) for k, v in times.items()}))
    return out


def section(results, args) -> str:
    m = benchlib.machine()
    names = list(results[0][2])
    lines = ["| rows B | slots T | " + " | ".join(f"{n} ms" for n in names) + " | inverse / argmax | Gumbel / argmax |",
             "|" + "---|" * (len(names) + 4)]
    for b, t, ms in results:
        inv, gum, arg = (ms[n] for n in names)
        lines.append(f"| {b} | {t} | " + " | ".join(f"{ms[n]:.2f}" for n in names) + f" | {inv / arg:.2f}x | {gum / arg:.2f}x |")
    return (f"## What a sampled token costs (`tools/bench_sampling.py`)\n\n"
            f"`python tools/bench_sampling.py --rounds {args.rounds} --top-p {args.top_p}` "
            f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC); {m['cpu']}, {m['cores']} cores, {m['device']}, "
            f"jax {m['jax']}. Vocabulary {args.vocab}{' (SmolLM2' + chr(39) + 's)' if args.vocab == 49152 else ''}, temperature 1, top-p {args.top_p}; median of "
            f"{args.rounds} alternating rounds per variant, one jitted call each.\n\n" + "\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=benchlib.at_least(2), default=49152)
    ap.add_argument("--rounds", type=benchlib.at_least(1), default=21)
    ap.add_argument("--top-p", type=float, default=1.0, help="1.0: no top-p filter (the server's default)")
    ap.add_argument("--output", default="BENCHMARKS.md")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    benchlib.publish(section(measure(args.vocab, args.rounds, args.top_p), args), args, f"top_p={args.top_p}", "bench_sampling")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
