"""What ``n_max="auto"`` costs where drafting never pays: plain decoding against auto, side by side.

Auto runs under a cost model in which drafting never pays and every probe (the propose after a
plain run) verifies one draft, so all it does is what it does on text its drafter cannot predict:
plain steps (which also capture the target's hidden states and extend the drafter's context) and
probes after plain runs of 1, 2, 4, then at most ``MAX_BACKOFF`` steps. A third configuration runs
auto's program with plain steps only (no probe): the price of the plain step alone. The compiled
on-device loops of ``tools/bench_spec.py`` at the API's default capacity, greedy, the chat prompts
as one batch, alternating runs in one process; the medians of decode tokens/s count. Results go to
a section of ``BENCHMARKS.md``::

    python tools/bench_plain_steps.py                 # batch 8, 8 prompts, 32 new tokens, 4 runs
    python tools/bench_plain_steps.py --batch 1 --no-write
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
from prompts import CHAT_PROMPTS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together (the first chat prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=4, help="runs of each, alternating; the median counts")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import dflash_jax as dj
    from bench_spec import fresh_state, setup, state_for
    from dflash_jax.decode import loop as decode
    from dflash_jax.arguments import default_max_len
    from dflash_jax.decode.auto.costs import NEVER, CostModel, depth_policy
    from dflash_jax.decode.auto.policy import MAX_BACKOFF, Calibration

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    prompts = [dj.encode_prompt(target, t) for t in CHAT_PROMPTS[: args.batch]]
    capacity = default_max_len(prompts, args.max_new_tokens)
    rows = jnp.int32(len(prompts))
    prepared, states = {}, {}
    for kind in ("plain", "auto"):
        static, params = setup(target, drafter, kind)
        if kind == "auto":  # every propose verifies the narrowest width and never pays
            n, widths = static.depth, static.auto_widths
            probe_one = CostModel(step_cost=(tuple(1.0 if w == widths[0] else 1e6 for w in widths),), plain_cost=(1e-6,), widths=widths)
            params = params._replace(depth=depth_policy(drafter.calibration or Calibration.identity(n), probe_one, depth=n))
        states["plain" if kind == "plain" else "dflash"] = st = fresh_state(target, static, params, prompts, args, capacity)
        prepared[kind] = (static, params, decode.generate_until.lower(params, st, static, rows).compile())
    # "plain steps only": auto's program from a state whose schedule says plain throughout (no probe at all)
    configs = {"plain": ("plain", None), "auto": ("auto", None), "auto, plain steps only": ("auto", NEVER)}
    rates = {k: [] for k in configs}
    stats = {}
    for r in range(args.runs + 1):  # the first round is untimed (an executable's first call is slow)
        for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            kind, plain_left = configs[name]
            static, params, loop = prepared[kind]
            st = state_for(states, static)
            if plain_left is not None:
                st = st.replace(speculative=st.speculative.replace(plain_left=jnp.int32(plain_left)))
            before = jax.device_get(st.length).sum()
            t0 = time.perf_counter()
            st = jax.block_until_ready(loop(params, st, rows))
            seconds = time.perf_counter() - t0
            if r:
                rates[name].append(float(jax.device_get(st.length).sum() - before) / seconds)
            stats[name] = dj.api.spec_stats(st) if st.speculative is not None else {}
        if r:
            print(" ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = machine()
    cmd = shlex.join(["python", "tools/bench_plain_steps.py", *(sys.argv[1:] if argv is None else argv)])
    table = "\n".join(f"| {k} | {med[k]:.1f} | **{med[k] / med['plain']:.2f}x** | {stats[k].get('widths', [0, 0])[1]} | {stats[k].get('plain_steps', '-')} | "
                      f"{', '.join(f'{x:.1f}' for x in rates[k])} |" for k in configs)
    text = f"""## What auto costs where drafting never pays (`tools/bench_plain_steps.py`)

`{cmd}` ({when}); the default target and its shipped drafter, the first {args.batch} chat prompts as one batch,
greedy, {args.max_new_tokens} new tokens, the API's default capacity; {args.runs} timed runs of each, alternating (after
one untimed round), medians. Auto runs under a cost model in which drafting never pays and each probe verifies one
draft: plain runs of 1, 2, 4, then at most {MAX_BACKOFF} steps between probes. "Plain steps only" runs auto's program
from a state whose schedule says plain throughout: no probe, so it prices the plain step alone (it captures the
target's hidden states and extends the drafter's context).

| decoding | tokens/s | against plain | probes (one-draft verifies) | plain steps | runs (tokens/s) |
|---|---|---|---|---|---|
{table}

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    publish(text, args, "plain_steps", "bench_plain_steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
