"""Tau of the sampled accept rules (issue 49): sample-and-match (the default: a draft is accepted
while it equals the target's sample at its position) against the standard rejection rule (accept
with ``min(1, p/q)``, resample from the residual: ``draft_mode="reject"``), at temperature 0.7 and
at 0.7 with top-p 0.9, on the held-out prompts (:data:`~dflash_jax.assets.prompts.CODE_PROMPTS`
and :data:`~dflash_jax.assets.prompts.CHAT_PROMPTS`, 16 each, as users write them), the default
model and its shipped drafter, 128 new tokens, a chain of ``--n-max`` drafts (every step verifies
all of them, so the rules meet the same drafts' distributions).

Rows, each with the same seed:

* ``argmax / match``: the drafter's argmax drafted, accepted while it equals the target's sample
  (the default's drafts; its tree holds argmax candidates too). A one-hot ``q`` makes the rejection
  rule accept with ``p(draft)``, what matching accepts: the two rules are the same rule here.
* ``sample / match``: drafts drawn from the drafter's distribution at the request's temperature
  (and top-p) with the target's positional uniform, accepted while equal.
* ``sample / reject``: the same drafts' distribution, the rejection rule.
* ``argmax tree / match``: the default's drafts, a best-first tree of 3 nodes (the shipped
  drafter's recorded tree) over the same depth; its distinct argmax candidates make the two rules
  one rule again (the target's sample is accepted where it is a child).

Tau (tokens per verify step, bonus included) is a count, not a timing: the machine's load does not
move it. Each call holds the 16 prompts of a kind (rows are independent under a fixed depth).

    python tools/bench_accept_rule.py              # the table (markdown)
    python tools/bench_accept_rule.py --quick      # 4 prompts per kind, 32 tokens
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dflash_jax as dj  # noqa: E402
from dflash_jax.assets.prompts import CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402

RULES = (("argmax / match", "argmax", 0), ("sample / match", "sample", 0), ("sample / reject", "reject", 0),
         ("argmax tree / match", "argmax", 3))
SETTINGS = (("T 0.7", dj.SamplingConfig(temperature=0.7)), ("T 0.7, top-p 0.9", dj.SamplingConfig(temperature=0.7, top_p=0.9)))


def measure(target, drafter, ids, sampling, mode, n_max, tokens, seed, tree=0) -> dict:
    """One call over ``ids``: tau, acceptance of drafts and the outputs."""
    res = dj.generate(target, ids, max_new_tokens=tokens, drafter=drafter, n_max=n_max, tree=tree, draft_mode=mode,
                      sampling=sampling, seed=seed)
    s = res.stats
    return dict(tau=s["tau"], accepted=s["accepted_tokens"], drafted=s["drafted_tokens"], outputs=res.output_ids)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 prompts per kind, 32 new tokens")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--n-max", type=int, default=3, help="drafts per chain step (default 3: the shipped drafter's auto depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rules", default="1,2,3,4", help="comma-separated rule numbers (1-4) to run")
    p.add_argument("--settings", default="1,2", help="comma-separated sampling settings (1: T 0.7, 2: T 0.7 top-p 0.9)")
    args = p.parse_args(argv)
    rules = [RULES[int(k) - 1] for k in args.rules.split(",")]
    settings = [SETTINGS[int(k) - 1] for k in args.settings.split(",")]
    tokens = 32 if args.quick else args.tokens
    n = 4 if args.quick else 16
    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    print(f"n_max {args.n_max} (chain), {tokens} new tokens, seed {args.seed}; tau (accepted / drafted)\n")
    print("| sampling | text | " + " | ".join(r[0] for r in rules) + " |")
    print("|---|---|" + "---|" * len(rules))
    for sname, sampling in settings:
        for kind, prompts in (("code", CODE_PROMPTS[:n]), ("chat", CHAT_PROMPTS[:n])):
            ids = [dj.encode_prompt(target, q) for q in prompts]
            cells = []
            for _, mode, tree in rules:
                t0 = time.perf_counter()
                r = measure(target, drafter, ids, sampling, mode, args.n_max, tokens, args.seed, tree)
                cells.append(f"{r['tau']:.3f} ({r['accepted']} / {r['drafted']})")
                print(f"  {sname} {kind} {mode} tree {tree}: {cells[-1]} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            print(f"| {sname} | {kind} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
