"""Decode steps of a paged serving batch against an unpaged one, side by side (``dflash_jax/serve/pages.py``).

The default pair (the embedded SmolLM2 target and its shipped drafter, DFlash at a fixed
``--n-max``) in two :class:`~dflash_jax.serve.batch.Batch` es of ``--rows`` rows and
``--max-len`` tokens, one whose K/V and drafter context live in a pool of pages, one with a
buffer per row; every row is prefilled with ``--context`` random tokens and decodes without
stopping. Rounds of ``--steps`` decode steps alternate between the two (``--rounds`` each); the
figure is the median time per step and the ratio paged / unpaged. The tokens of both must agree.

    python tools/bench_paged.py                      # contexts 128,1024,1900; writes its section of BENCHMARKS.md
    python tools/bench_paged.py --context 1900 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from benchlib import int_list, machine, publish  # noqa: E402


def batches(args, context: int):
    import jax

    from dflash_jax.decode.static import Decoding, Params
    from dflash_jax.loading import load_target, shipped_drafter
    from dflash_jax.serve.batch import Batch
    from dflash_jax.serve.pages import PAGE_SIZE, row_bytes

    target = load_target()
    drafter = shipped_drafter(target)
    static = Decoding(target.cfg, drafter.cfg, n_max=args.n_max)
    params = Params(target.params, drafter.params)
    budget = args.rows * row_bytes(static, args.max_len)
    pages = budget // row_bytes(static, PAGE_SIZE) + 1
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(10, target.cfg.vocab_size - 10, context)] for _ in range(args.rows)]
    budget_new = args.max_len - context - 1
    out = {}
    for name, kv_pages in (("paged", pages), ("rows", None)):
        b = Batch(params, static, args.rows, args.max_len, 1, 256, kv_pages=kv_pages)
        p = b.start_prefill(list(range(args.rows)), prompts, [budget_new] * args.rows, [0] * args.rows, [[]] * args.rows)
        while not p.complete:
            b.prefill_step(p)
        if b.pool is not None:
            b.grow({r: args.max_len for r in range(args.rows)})
        b.run(args.rows + 1, 1)  # compiles the round's programs
        jax.block_until_ready(b.state.tokens)
        out[name] = b
    return out


def measure(args, context: int) -> dict:
    import jax

    bs = batches(args, context)
    times = {name: [] for name in bs}
    for i in range(args.rounds):
        for name in (list(bs) if i % 2 == 0 else list(bs)[::-1]):
            b = bs[name]
            t0 = time.perf_counter()
            b.run(args.rows + 1, args.steps)
            jax.block_until_ready(b.state.tokens)
            times[name].append((time.perf_counter() - t0) / args.steps)
    (tp, lp, _), (tr, lr, _) = bs["paged"].read(), bs["rows"].read()
    n = min(lp.min(), lr.min())
    same = bool(np.array_equal(tp[:, :n], tr[:, :n]))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return dict(context=context, paged_ms=med["paged"], rows_ms=med["rows"], ratio=med["paged"] / med["rows"], same=same)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int_list, default=[128, 1024, 1900], help="prompt tokens per row (default 128,1024,1900)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--n-max", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="decode steps per timed round (default 4, the server's)")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per layout (default 6)")
    p.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    rows = []
    for c in args.context:
        r = measure(args, c)
        print(f"context {c}: paged {r['paged_ms']:.1f} ms/step, rows {r['rows_ms']:.1f} ms/step, {r['ratio']:.2f}x, same tokens {r['same']}", flush=True)
        rows.append(r)
    m = machine()
    command = "python tools/bench_paged.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["### Paged KV against a buffer per row: decode steps (`tools/bench_paged.py`)", "",
             f"{datetime.date.today()}, {m['cpu']} ({m['cores']} cores), JAX {m['jax']}; `{command}`. The default pair, DFlash at "
             f"n_max {args.n_max}, {args.rows} rows of `--max-len {args.max_len}` decoding without stopping; rounds of {args.steps} "
             f"steps alternate between the layouts, median of {args.rounds} each. What differs is how attention reads the target "
             "cache and the drafter context: key blocks gathered through page tables, or sliced from one buffer per row.", "",
             "| context (tokens) | paged (ms/step) | rows (ms/step) | paged / rows | same tokens |", "|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['paged_ms']:.1f} | {r['rows_ms']:.1f} | {r['ratio']:.2f}x | {r['same']} |" for r in rows]
    publish("\n".join(lines), args, "Paged KV decode steps", "bench_paged")


if __name__ == "__main__":
    main()
