"""Chains against trees of the same verify width (``Decoding(tree=N)``), side by side with plain decoding.

The default target and its shipped drafter, greedy, batch 1 (``--batch``), the first prompts of ``tools/prompts.py``'s
held-out ``CODE_PROMPTS`` and ``CHAT_PROMPTS`` (chat template applied), at the capacity the API gives
them; each configuration's on-device loop (``decode.generate_until``) runs a fixed number of steps
from the same prefilled states, configurations alternating round by round; the median of
milliseconds per committed token counts. Results go to a section of ``BENCHMARKS.md``::

    python tools/bench_tree.py                  # 3 prompts per set, 48 steps, 3 timed rounds
    python tools/bench_tree.py --prompts 8 --batch 8            # one batch of 8 rows per set
    python tools/bench_tree.py --prompts 1 --steps 16 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, publish  # noqa: E402
from prompts import CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402

# (n_max, tree, auto_depth): n_max 0 is plain decoding; "auto" chooses each step's width (or a plain step)
# from its measured step costs, kept in depth_costs/ as users' runs keep them
CONFIGS = [(0, None, None), (1, None, None), (3, None, None), (3, 3, None), (7, 7, None),
           ("auto", None, 1), ("auto", 3, 2), ("auto", 3, 3), ("auto", 7, 3)]


def label(n_max, tree, auto_depth) -> str:
    if n_max == 0:
        return "plain"
    if n_max == "auto":
        what = f"{auto_depth} draft{'s' if auto_depth > 1 else ''}" if tree is None else f"a tree of {tree} nodes, {auto_depth} deep"
        return f"auto over {what}"
    return f"chain of {n_max}" if tree is None else f"tree of {tree} (n_max {n_max})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=3, help="prompts per set")
    p.add_argument("--steps", type=int, default=48, help="decode steps per prompt and configuration")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed round)")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (prompts cycled to fill whole batches)")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    p.add_argument("--configs", nargs="+", default=None, help="only these configurations (their labels; plain first)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import dflash_jax as dj
    from dflash_jax.decode import loop as decode
    from dflash_jax.arguments import default_max_len
    from dflash_jax.decode.static import Decoding, Params

    from dflash_jax.decode.auto import costs
    from dflash_jax.decode.auto.policy import Calibration

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    configs = [c for c in CONFIGS if args.configs is None or label(*c) in args.configs]
    rows, chosen = [], []
    for name, texts in (("code", CODE_PROMPTS), ("chat", CHAT_PROMPTS)):
        prompts = [dj.encode_prompt(target, t) for t in texts[: args.prompts]]
        prompts = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // args.batch) * args.batch)]  # whole batches
        batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
        capacity = default_max_len(prompts, 4 * args.steps)
        rows_done = jnp.int32(args.batch)
        prepared = {}
        for c in configs:
            n_max, tree, auto_depth = c
            plain = n_max == 0
            static = Decoding(target.cfg) if plain else Decoding(target.cfg, drafter.cfg, n_max=n_max, tree=tree, auto_depth=auto_depth)
            params = Params(target.params) if plain else Params(target.params, drafter.params)
            if static.adaptive:  # a policy of the right shapes to compile with; its costs come below
                calibration = drafter.calibration or Calibration.identity(static.depth)
                top = static.auto_widths[-1]
                params = params._replace(depth=costs.depth_policy(calibration, costs.CostModel.forcing(top, top, static.auto_widths), depth=static.depth))
            states = [decode.prefill(params, decode.init_state(static, b, capacity, 4 * args.steps, target.eos_ids), static, 256,
                                     max(map(len, b))) for b in batches]
            loop = decode.generate_until.lower(params, states[0], static, rows_done, jnp.int32(args.steps)).compile()
            if static.adaptive:
                key = costs.cost_key(static, params, args.batch, (target.source, drafter.source))
                run = lambda p, s, loop=loop: loop(p, s, rows_done, jnp.int32(args.steps))  # noqa: E731
                params, model = costs.adaptive_params(params, static, calibration, run, key, states[0])
                if name == "code":
                    chosen.append(f"{label(*c)}: widths {model.widths} {[round(1e3 * x, 1) for x in model.step_cost[0]]} ms, "
                                  f"plain step {1e3 * model.plain_cost[0]:.1f} ms ({(model.info or {}).get('source', 'given')})")
            prepared[c] = (params, states, loop)
        per_token = {c: [] for c in prepared}
        tokens = {}
        for r in range(args.rounds + 1):
            for c in (list(prepared) if r % 2 == 0 else list(prepared)[::-1]):
                params, states, loop = prepared[c]
                seconds, count = 0.0, 0
                for st0 in states:
                    st = jax.block_until_ready(jax.tree.map(lambda x: jnp.array(x, copy=True), st0))
                    t0 = time.perf_counter()
                    st = jax.block_until_ready(loop(params, st, rows_done, jnp.int32(args.steps)))
                    seconds += time.perf_counter() - t0
                    count += int((st.length - st0.length).sum())
                if r:
                    per_token[c].append(seconds / count * 1e3)
                tokens[c] = count
        base = statistics.median(per_token[configs[0]])
        for c in prepared:
            ms = statistics.median(per_token[c])
            widest = 1 if c[0] == 0 else (c[1] or (c[2] if c[0] == "auto" else c[0])) + 1
            rows.append(f"| {name} | {label(*c)} | {widest} | {tokens[c] / (args.steps * len(prompts)):.2f} | "
                        f"{ms:.1f} | **{base / ms:.2f}x** |")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = machine()
    cmd = shlex.join(["python", "tools/bench_tree.py", *(sys.argv[1:] if argv is None else argv)])
    table = "\n".join(rows)
    title = "" if args.batch == 1 else f", batch {args.batch}"
    text = f"""## Chains and trees of the same verify width{title} (`tools/bench_tree.py`)

`{cmd}` ({when}); the default target (float32) and its shipped drafter, greedy, batch {args.batch}, the first {args.prompts}
prompts of `CODE_PROMPTS` and `CHAT_PROMPTS` (held out, written as users write them), the capacity the API gives
them, {args.steps} steps of each configuration's on-device loop per prompt, configurations alternating, the median of
{args.rounds} timed rounds. Tokens per step and row include the bonus token (tau); an auto step may be a plain step. "auto" reads
the step costs kept in `depth_costs/` for this machine, or measures them first, as `generate` does.

| set | decoding | widest target pass (tokens per row) | tokens per step and row | ms per token | against plain |
|---|---|---|---|---|---|
{table}

Step costs auto used (batch {args.batch}): {"; ".join(chosen) or "none"}.

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    publish(text, args, "tree" if args.batch == 1 else f"tree batch {args.batch}", "bench_tree")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
