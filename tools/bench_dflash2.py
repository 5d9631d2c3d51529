"""DFlash2's step cost against DFlash's: one target, two drafters of the same shape (the DFlash2 one
adds the grouped dynamic convolutions and the candidate selector), steps of fixed acceptance timed
alternating in one process; optionally DFlash2 over best-first trees (selector-ranked) against its chain.

    PYTHONPATH=. python tools/bench_dflash2.py                       # SmolLM2-135M shapes, float32
    PYTHONPATH=. python tools/bench_dflash2.py --shape qwen3-8b --context 512 --tree 7

Random weights of the shapes in :mod:`dflash_jax.shapes` (speed does not depend on their values);
the step is :func:`gpu_measure.fixed_acceptance_step` (a real propose and verify, the acceptance
scripted), so tau is not measured here: it needs a trained drafter.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchlib import busy_seconds, machine  # noqa: E402
from dflash_jax.decode.state import Decoding, Params  # noqa: E402
from dflash_jax.decode.step import proposal_fn  # noqa: E402
from dflash_jax.drafter import model as drafter  # noqa: E402
from dflash_jax.drafter.config import DFLASH2_DRAFTER  # noqa: E402
from dflash_jax.shapes import configs, random_models  # noqa: E402
from gpu_measure import Generation  # noqa: E402


def dflash2_of(dcfg, kernel: int, group: int, rank: int, top_k: int):
    """The DFlash2 drafter config of the same shape as ``dcfg`` (a DFlash drafter)."""
    return dataclasses.replace(dcfg, architecture=DFLASH2_DRAFTER, conv_kernel_size=kernel, conv_group_size=group,
                               selector_rank=rank, selector_top_k=top_k)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", help="a shape of dflash_jax.shapes.REAL (default smollm2-135m)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    p.add_argument("--accept", type=int, default=3, help="drafts each step accepts (scripted)")
    p.add_argument("--steps", type=int, default=16, help="steps per timed run")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (median)")
    p.add_argument("--tree", type=int, default=0, help="also time DFlash2 over best-first trees of this many nodes")
    p.add_argument("--conv", default="2,16", help="conv_kernel_size,conv_group_size (default Qwen3.8-27B-DFlash2's 2,16)")
    p.add_argument("--selector", default="256,16", help="selector_rank,selector_top_k (default 256,16)")
    args = p.parse_args(argv)
    kernel, group = map(int, args.conv.split(","))
    rank, top_k = map(int, args.selector.split(","))
    cfg, dcfg = configs(args.shape, args.dtype)
    d2cfg = dflash2_of(dcfg, kernel, group, rank, top_k)
    params, dparams = random_models(cfg, dcfg)
    d2params = dict(dparams, **{k: v for k, v in drafter.init_params(d2cfg, jax.random.key(1)).items() if k not in dparams})
    d2params["layers"] = dict(dparams["layers"], **{k: v for k, v in drafter.init_params(d2cfg, jax.random.key(2))["layers"].items()
                                                     if k not in dparams["layers"]})
    capacity = args.context + 1 + args.steps * (dcfg.block_size + 1) + 16
    kinds = {"DFlash": Generation(Params(params, dparams), Decoding(cfg, dcfg), capacity, 256),
             "DFlash2": Generation(Params(params, d2params), Decoding(cfg, d2cfg), capacity, 256)}
    if args.tree:
        kinds[f"DFlash2 tree {args.tree}"] = Generation(Params(params, d2params), Decoding(cfg, d2cfg, tree=args.tree), capacity, 256)
    states = {k: g.prefilled(args.context, 1 + args.steps * (args.accept + 1))[0] for k, g in kinds.items()}
    times = {k: [] for k in kinds}
    busy0, t0 = busy_seconds(), time.perf_counter()
    for _ in range(args.rounds):
        for k, g in kinds.items():
            r = g.run(states[k], args.accept, 1)
            times[k].append(1e3 * r["seconds"] / r["steps"])
    busy1, wall = busy_seconds(), time.perf_counter() - t0
    load = None if busy0 is None else round((busy1 - busy0) / wall, 2)
    print(f"machine: {machine()}; busy CPUs during the timing (all processes, this one included): {load} over {wall:.0f} s")
    print(f"shape {args.shape} {args.dtype}, block {dcfg.block_size}, context {args.context}, accept {args.accept}, "
          f"conv {kernel}x{group}, selector rank {rank} top {top_k}, {args.rounds} alternating rounds of {args.steps} steps")
    print("| drafter | step ms (median) | min - max | against DFlash (median of per-round ratios) |\n|---|---|---|---|")
    for k, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times["DFlash"]))
        print(f"| {k} | {statistics.median(t):.2f} | {min(t):.2f} - {max(t):.2f} | {ratio:.3f}x |")
    propose_times(kinds, states, args.rounds * 3)
    return 0


def propose_times(kinds: dict, states: dict, rounds: int) -> None:
    """The drafter's part alone: the propose (draft pass, logits, the selector's walk) of each
    chain kind from its prefilled state, alternating, ``rounds`` times; prints a table."""
    fns = {k: jax.jit(lambda params, state, static=g.static: proposal_fn(params, state, static)[:2])
           for k, g in kinds.items() if not g.static.tree}
    times = {k: [] for k in fns}
    for k, f in fns.items():
        jax.block_until_ready(f(kinds[k].params, states[k]))
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(kinds[k].params, states[k]))
            times[k].append(1e3 * (time.perf_counter() - t0))
    print(f"\npropose alone, {rounds} alternating calls\n| drafter | propose ms (median) | against DFlash (median of per-call ratios) |\n|---|---|---|")
    for k, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times["DFlash"]))
        print(f"| {k} | {statistics.median(t):.2f} | {ratio:.3f}x |")


if __name__ == "__main__":
    sys.exit(main())
