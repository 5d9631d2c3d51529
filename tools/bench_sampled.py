"""Sampled requests of the default pair, measured (issue 49): two commands.

``accept``: tau of the sampled accept rules: sample-and-match (the default: a draft is accepted
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

    python tools/bench_sampled.py accept              # the table (markdown)
    python tools/bench_sampled.py accept --quick      # 4 prompts per kind, 32 tokens

``rounding``: why a seeded sample of the default pair may depart from plain decoding's (issue
49): float rounding at a boundary of the cumulative distribution, measured.

For each held-out prompt (:data:`~dflash_jax.assets.prompts.CHAT_PROMPTS`, then
:data:`~dflash_jax.assets.prompts.CODE_PROMPTS`; 16 each), at temperature 0.7 with seed = the
prompt's index, batch 1, 128 new tokens:

1. the default pair (``dj.generate`` with the shipped drafter, every other setting at its
   default) and plain decoding, compared token by token (the first departure is printed);
2. the target's logits at every generated position computed twice after one prefill of the prompt:
   by one-token passes (what plain decoding runs) and by passes of ``--block`` tokens (what a
   verify runs; the default tree's widest pass is 4 tokens), both over plain decoding's tokens;
   then, with each position's own uniform (:func:`dflash_jax.decode.sampling.uniform_at`), the
   token each would draw, the largest logit difference, and the measure of the uniforms that draw
   a different token (one minus the overlap of each token's two intervals of the cumulative
   distributions: the chance that a uniform falls between a boundary and its shifted place).

The expected departures per 128-token sample is then that measure summed over the positions. A
departure the logits explain shows the draw's distance to the boundary below the shift there.

    python tools/bench_sampled.py rounding [--kinds chat,code] [--prompts 16] [--tokens 128]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
from dflash_jax.assets.prompts import CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402
from dflash_jax.decode.sampling import RowSampling, row_keys, uniform_at, warp_logits  # noqa: E402
from dflash_jax.families.registry import module_for  # noqa: E402

RULES = (("argmax / match", "argmax", 0), ("sample / match", "sample", 0), ("sample / reject", "reject", 0),
         ("argmax tree / match", "argmax", 3))
SETTINGS = (("T 0.7", dj.SamplingConfig(temperature=0.7)), ("T 0.7, top-p 0.9", dj.SamplingConfig(temperature=0.7, top_p=0.9)))


def measure(target, drafter, ids, sampling, mode, n_max, tokens, seed, tree=0) -> dict:
    """One call over ``ids``: tau, acceptance of drafts and the outputs."""
    res = dj.generate(target, ids, max_new_tokens=tokens, drafter=drafter, n_max=n_max, tree=tree, draft_mode=mode,
                      sampling=sampling, seed=seed)
    s = res.stats
    return dict(tau=s["tau"], accepted=s["accepted_tokens"], drafted=s["drafted_tokens"], outputs=res.output_ids)


def accept_main(args) -> None:
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


T = 0.7


@functools.partial(jax.jit, static_argnums=(1,))
def _pass(params, cfg, tokens, positions, cache):
    mod = module_for(cfg)
    hidden, cache, _ = mod.forward_hidden(params, cfg, tokens, positions, cache)
    return mod.lm_head(params, cfg, hidden), cache


def target_logits(target, seq, prompt_len, block) -> np.ndarray:
    """``[n, V]`` float32 the target's logits for the tokens at ``prompt_len .. len(seq) - 1`` of
    ``seq``: the prompt in one pass, then passes of ``block`` tokens (the last pass padded)."""
    cfg, params = target.cfg, target.params
    cache = module_for(cfg).init_cache(cfg, 1, 1024)  # one size: the passes compile once
    ids = jnp.asarray([seq[:prompt_len]], jnp.int32)
    lg, cache = _pass(params, cfg, ids, jnp.arange(prompt_len, dtype=jnp.int32)[None], cache)
    out = [np.asarray(lg[0, -1:])]
    for s in range(prompt_len, len(seq) - 1, block):
        chunk = list(seq[s : s + block])
        n = len(chunk)
        chunk += [0] * (block - n)
        lg, cache = _pass(params, cfg, jnp.asarray([chunk], jnp.int32), jnp.arange(s, s + block, dtype=jnp.int32)[None], cache)
        out.append(np.asarray(lg[0, :n]))
    return np.concatenate(out)[: len(seq) - prompt_len]


def draws(logits: np.ndarray, u: np.ndarray):
    """``(tokens [n], cdf [n, V])``: sample_at's inverse transform in float32."""
    sampling = RowSampling.of(dj.SamplingConfig(temperature=T), logits.shape[0])
    p = jax.nn.softmax(warp_logits(jnp.asarray(logits)[:, None], sampling)[:, 0], axis=-1)
    c = np.asarray(jnp.cumsum(p, axis=-1))
    v = np.minimum(u * c[:, -1], np.nextafter(c[:, -1], 0))
    return np.sum(c <= v[:, None], axis=-1), c, v


def flip_measure(c1: np.ndarray, c2: np.ndarray) -> np.ndarray:
    """``[n]`` the measure of the uniforms in ``[0, 1)`` that draw different tokens from the two
    cumulative distributions ``[n, V]`` (each normalized by its total): one minus the overlap of
    each token's two intervals."""
    a = np.asarray(c1, np.float64) / np.asarray(c1, np.float64)[:, -1:]
    b = np.asarray(c2, np.float64) / np.asarray(c2, np.float64)[:, -1:]
    lo = np.maximum(np.pad(a, ((0, 0), (1, 0)))[:, :-1], np.pad(b, ((0, 0), (1, 0)))[:, :-1])
    return 1.0 - np.maximum(np.minimum(a, b) - lo, 0.0).sum(axis=-1)


def rounding_main(args) -> None:
    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    sampling = dj.SamplingConfig(temperature=T)
    total_flip = 0.0
    n_pos = departures = flips = mismatched = 0
    for kind in args.kinds.split(","):
        prompts = {"chat": CHAT_PROMPTS, "code": CODE_PROMPTS}[kind][: args.prompts]
        for i, text in enumerate(prompts):
            ids = dj.encode_prompt(target, text)
            plain = dj.generate(target, [ids], max_new_tokens=args.tokens, sampling=sampling, seed=i).output_ids[0]
            spec = dj.generate(target, [ids], max_new_tokens=args.tokens, sampling=sampling, seed=i, drafter=drafter).output_ids[0]
            first = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
            if first is None and len(plain) != len(spec):
                first = min(len(plain), len(spec))
            seq = list(ids) + list(plain)
            index = jnp.arange(len(ids), len(seq), dtype=jnp.int32)[None]
            u = np.asarray(uniform_at(row_keys(i, 1), index)[0], np.float64)
            lg1 = target_logits(target, seq, len(ids), 1)
            lgb = target_logits(target, seq, len(ids), args.block)
            t1, c1, v1 = draws(lg1, u)
            tb, cb, _ = draws(lgb, u)
            measure = flip_measure(c1, cb)
            total_flip += float(measure.sum())
            n_pos += len(plain)
            mismatched += int(np.sum(t1 != np.asarray(plain)))
            for k in np.flatnonzero(t1 != np.asarray(plain)):  # this program's rounding against the decode loop's
                print(f"{kind} {i:2d}: token {k + 1} replayed as {t1[k]}, plain decoding drew {plain[k]}; u*total {v1[k]:.9f}, "
                      f"nearest boundary {np.abs(c1[k] - v1[k]).min():.2e} away", flush=True)
            flips += int(np.sum(t1 != tb))
            dl = np.abs(lg1 - lgb).max()
            line = f"{kind} {i:2d}: {len(plain)} tokens, max |logit 1-token - {args.block}-token| {dl:.2e}, flip measure {measure.sum():.2e}"
            if first is not None:
                departures += 1
                k = first
                tok = plain[k] if k < len(plain) else None
                gap = np.abs(c1[k] - v1[k]).min()
                line += (f"; DEPARTS at token {k + 1}: plain {tok}, DFlash {spec[k] if k < len(spec) else None}; u*total {v1[k]:.9f}, "
                         f"nearest boundary {gap:.2e} away, the boundaries moved up to {np.abs(c1[k] - cb[k]).max():.2e} there "
                         f"(logits differ up to {np.abs(lg1[k] - lgb[k]).max():.2e})")
            print(line, flush=True)
    print(f"\n{departures} departures of DFlash's sample from plain's in {n_pos // max(1, args.tokens)}-ish samples; "
          f"replayed 1-token logits drew another token than plain decoding at {mismatched} of {n_pos} positions; "
          f"1-token vs {args.block}-token logits drew different tokens at {flips} positions; expected flips from the "
          f"measure: {total_flip:.3f} over {n_pos} positions ({total_flip / max(1, n_pos):.2e} per token)")

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    acc = sub.add_parser("accept", help="tau of the accept rules (the table)")
    acc.add_argument("--quick", action="store_true", help="4 prompts per kind, 32 new tokens")
    acc.add_argument("--tokens", type=int, default=128)
    acc.add_argument("--n-max", type=int, default=3, help="drafts per chain step (default 3: the shipped drafter's auto depth)")
    acc.add_argument("--seed", type=int, default=0)
    acc.add_argument("--rules", default="1,2,3,4", help="comma-separated rule numbers (1-4) to run")
    acc.add_argument("--settings", default="1,2", help="comma-separated sampling settings (1: T 0.7, 2: T 0.7 top-p 0.9)")
    rnd = sub.add_parser("rounding", help="seeded DFlash samples against plain ones, and the rounding that explains departures")
    rnd.add_argument("--kinds", default="chat,code")
    rnd.add_argument("--prompts", type=int, default=16)
    rnd.add_argument("--tokens", type=int, default=128)
    rnd.add_argument("--block", type=int, default=4)
    args = p.parse_args(argv)
    (accept_main if args.command == "accept" else rounding_main)(args)


if __name__ == "__main__":
    main()
