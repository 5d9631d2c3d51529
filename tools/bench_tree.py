"""Chains against trees of the same verify width (``Decoding(tree=N)``), side by side with plain decoding.

The default target and its shipped drafter, greedy, batch 1, the first prompts of ``tools/prompts.py``'s
held-out ``CODE_PROMPTS`` and ``CHAT_PROMPTS`` (chat template applied), at the capacity the API gives
them; each configuration's on-device loop (``decode.generate_until``) runs a fixed number of steps
from the same prefilled states, configurations alternating round by round; the median of
milliseconds per committed token counts. Results go to a section of ``BENCHMARKS.md``::

    python tools/bench_tree.py                  # 3 prompts per set, 48 steps, 3 timed rounds
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

CONFIGS = [(0, None), (1, None), (3, None), (3, 3), (7, None), (7, 3), (7, 7)]  # (n_max, tree); n_max 0: plain


def label(n_max, tree) -> str:
    if n_max == 0:
        return "plain"
    return f"chain of {n_max}" if tree is None else f"tree of {tree} (n_max {n_max})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=3, help="prompts per set")
    p.add_argument("--steps", type=int, default=48, help="decode steps per prompt and configuration")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed round)")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import dflash_jax as dj
    from dflash_jax import decode
    from dflash_jax.arguments import default_max_len
    from dflash_jax.decoding import Decoding, Params

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    rows = []
    for name, texts in (("code", CODE_PROMPTS), ("chat", CHAT_PROMPTS)):
        prompts = [dj.encode_prompt(target, t) for t in texts[: args.prompts]]
        capacity = default_max_len(prompts, 4 * args.steps)
        prepared = {}
        for n_max, tree in CONFIGS:
            plain = n_max == 0
            static = Decoding(target.cfg) if plain else Decoding(target.cfg, drafter.cfg, n_max=n_max, tree=tree)
            params = Params(target.params) if plain else Params(target.params, drafter.params)
            states = [decode.prefill(params, decode.init_state(static, [ids], capacity, 4 * args.steps, target.eos_ids), static, 256, len(ids))
                      for ids in prompts]
            loop = decode.generate_until.lower(params, states[0], static, jnp.int32(1), jnp.int32(args.steps)).compile()
            prepared[(n_max, tree)] = (params, states, loop)
        per_token = {c: [] for c in prepared}
        tokens = {}
        for r in range(args.rounds + 1):
            for c in (list(prepared) if r % 2 == 0 else list(prepared)[::-1]):
                params, states, loop = prepared[c]
                seconds, count = 0.0, 0
                for st0 in states:
                    st = jax.block_until_ready(jax.tree.map(lambda x: jnp.array(x, copy=True), st0))
                    t0 = time.perf_counter()
                    st = jax.block_until_ready(loop(params, st, jnp.int32(1), jnp.int32(args.steps)))
                    seconds += time.perf_counter() - t0
                    count += int((st.length - st0.length).sum())
                if r:
                    per_token[c].append(seconds / count * 1e3)
                tokens[c] = count
        base = statistics.median(per_token[(0, None)])
        for c in prepared:
            ms = statistics.median(per_token[c])
            rows.append(f"| {name} | {label(*c)} | {1 if c[0] == 0 else (c[1] or c[0]) + 1} | {tokens[c] / (args.steps * len(prompts)):.2f} | "
                        f"{ms:.1f} | **{base / ms:.2f}x** |")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = machine()
    cmd = shlex.join(["python", "tools/bench_tree.py", *(sys.argv[1:] if argv is None else argv)])
    table = "\n".join(rows)
    text = f"""## Chains and trees of the same verify width (`tools/bench_tree.py`)

`{cmd}` ({when}); the default target (float32) and its shipped drafter, greedy, batch 1, the first {args.prompts}
prompts of `CODE_PROMPTS` and `CHAT_PROMPTS` (held out, written as users write them), the capacity the API gives
them, {args.steps} steps of each configuration's on-device loop per prompt, configurations alternating, the median of
{args.rounds} timed rounds. Tokens per step include the bonus token (tau). Fixed depths and fixed trees only: trees are
not yet an option of `generate`, the CLI or the server, and auto does not choose tree sizes.

| set | decoding | target pass (tokens) | tokens per step | ms per token | against plain |
|---|---|---|---|---|---|
{table}

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    publish(text, args, "tree", "bench_tree")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
