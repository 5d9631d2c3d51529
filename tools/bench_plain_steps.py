"""What ``n_max="auto"`` costs where drafting never pays: plain decoding against auto, side by side.

Auto runs under a cost model in which drafting never pays and every probe (the propose after a
plain run) verifies one draft, so all it does is what it does on text its drafter cannot predict:
plain steps (which also capture the target's hidden states and extend the drafter's context) and
probes after plain runs of 1, 2, 4, then at most ``MAX_BACKOFF`` steps. Through the API
(``dflash_jax.generate``, its default capacity), greedy, the chat prompts, alternating runs in one
process; the medians of decode tokens/s count. Results go to a section of ``BENCHMARKS.md``::

    python tools/bench_plain_steps.py                 # batch 8, 8 prompts, 32 new tokens, 4 runs
    python tools/bench_plain_steps.py --batch 1 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, write_section  # noqa: E402
from prompts import CHAT_PROMPTS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together (the first chat prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=4, help="runs of each, alternating; the median counts")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)

    import dflash_jax as dj
    from dflash_jax.costs import CostModel
    from dflash_jax.speculative.depth import MAX_BACKOFF

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    prompts = [dj.encode_prompt(target, t) for t in CHAT_PROMPTS[: args.batch]]
    n = drafter.cfg.block_size - 1
    probe_one = CostModel(step_cost=(tuple(1.0 if w == 1 else 1e6 for w in range(n + 1)),), plain_cost=(1e-6,))
    configs = {"plain": {}, "auto": dict(drafter=drafter, n_max="auto", cost_model=probe_one)}
    rates = {k: [] for k in configs}
    steps = {}
    for r in range(args.runs):
        for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            out = dj.generate(target, prompts, max_new_tokens=args.max_new_tokens, **configs[name])
            rates[name].append(out.stats["decode_tokens_per_s"])
            steps[name] = out.stats
        print(" ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    auto = steps["auto"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = machine()
    cmd = shlex.join(["python", "tools/bench_plain_steps.py", *(sys.argv[1:] if argv is None else argv)])
    text = f"""## What auto costs where drafting never pays (`tools/bench_plain_steps.py`)

`{cmd}` ({when}); the default target and its shipped drafter, the first {args.batch} chat prompts as one batch,
greedy, {args.max_new_tokens} new tokens, the API's default capacity; {args.runs} runs of each, alternating, medians.
Auto runs under a cost model in which drafting never pays and each probe verifies one draft (plain runs of 1, 2, 4,
then at most {MAX_BACKOFF} steps between probes).

| plain tokens/s | auto tokens/s | auto / plain | auto's probes (one-draft verifies) | auto's plain steps |
|---|---|---|---|---|
| {med['plain']:.1f} | {med['auto']:.1f} | **{med['auto'] / med['plain']:.2f}x** | {auto['widths'][1]} | {auto['plain_steps']} |

Runs: plain {", ".join(f"{x:.1f}" for x in rates['plain'])}; auto {", ".join(f"{x:.1f}" for x in rates['auto'])}.

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    print(text)
    if not args.no_write:
        write_section(Path(args.output), "plain_steps", text, tool="bench_plain_steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
