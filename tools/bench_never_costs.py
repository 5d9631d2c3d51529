"""The table of issue 49 ("speculation that never costs"): the default pair called as README's
Python API shows (``dj.generate(target, prompts, drafter=dj.shipped_drafter(target))``, every
other setting at its default: ``n_max="auto"``, the drafter's recorded tree), against plain
decoding (``drafter=None``), on the held-out prompts :data:`dflash_jax.assets.prompts.CODE_PROMPTS`
and :data:`~dflash_jax.assets.prompts.CHAT_PROMPTS` (16 each, as users write them), 128 new tokens:

* batch 1 greedy, each prompt alone;
* batch 1 at temperature 0.7, seeded (seed = the prompt's index);
* batch 8 greedy, 8 prompts in one call (two calls per kind of text).

Each call runs plain and DFlash back to back in one process, the order flipping call by call, after
one warm-up of each shape; the figure is the plain wall time over DFlash's, summed over the calls
(warm: compile excluded, prefill and decode included). Every greedy output is compared with plain
decoding's, every seeded sample with plain decoding's sample of that seed. The load average
(``os.getloadavg``) before and after each row is printed beside it: a figure taken beside other
jobs says little.

    python tools/bench_never_costs.py            # prints the table (markdown)
    python tools/bench_never_costs.py --quick    # 4 prompts per kind, 32 tokens: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dflash_jax as dj  # noqa: E402
from dflash_jax.assets.prompts import CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402

SETTINGS = (("batch 1, greedy", 1, None), ("batch 1, temperature 0.7, seeded", 1, dj.SamplingConfig(temperature=0.7)),
            ("batch 8, greedy", 8, None))


def _call(target, drafter, ids, tokens, sampling, seed):
    kw = dict(max_new_tokens=tokens, drafter=drafter, seed=seed)
    if sampling is not None:
        kw["sampling"] = sampling
    t0 = time.perf_counter()
    res = dj.generate(target, ids, **kw)
    return time.perf_counter() - t0, res


def row(target, drafter, prompts, batch, sampling, tokens) -> dict:
    """Plain and DFlash over ``prompts`` in calls of ``batch`` prompts, alternating."""
    ids = [dj.encode_prompt(target, p) for p in prompts]
    calls = [ids[i : i + batch] for i in range(0, len(ids), batch)]
    for d in (None, drafter):  # warm-up: compile (or read back) each shape, measure costs once
        _call(target, d, calls[0], tokens, sampling, 0)
    plain_s = spec_s = 0.0
    same = total = 0
    load = os.getloadavg()[0]
    for i, c in enumerate(calls):
        order = (None, drafter) if i % 2 == 0 else (drafter, None)
        out = {}
        for d in order:
            out[d is None] = _call(target, d, c, tokens, sampling, i)
        plain_s += out[True][0]
        spec_s += out[False][0]
        same += sum(a == b for a, b in zip(out[True][1].output_ids, out[False][1].output_ids))
        total += len(c)
    return dict(ratio=plain_s / spec_s, same=f"{same}/{total}", load=(load, os.getloadavg()[0]), plain_s=plain_s, spec_s=spec_s)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 prompts per kind, 32 new tokens")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--only", default="", help="comma-separated setting numbers to run (1-3; default all)")
    args = p.parse_args(argv)
    tokens = 32 if args.quick else args.tokens
    n = 8 if args.quick else 16
    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    only = {int(x) for x in args.only.split(",") if x} or {1, 2, 3}
    print("| setting | text | DFlash / plain | same as plain | load before / after |")
    print("|---|---|---|---|---|")
    for k, (name, batch, sampling) in enumerate(SETTINGS, 1):
        if k not in only:
            continue
        for kind, prompts in (("code", CODE_PROMPTS[:n]), ("chat", CHAT_PROMPTS[:n])):
            r = row(target, drafter, prompts, batch, sampling, tokens)
            print(f"| {name} | {kind} | {r['ratio']:.2f}x ({r['plain_s']:.1f} s / {r['spec_s']:.1f} s) | {r['same']} | "
                  f"{r['load'][0]:.1f} / {r['load'][1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
