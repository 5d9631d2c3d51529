"""The depth policy's constants, side by side: ``n_max="auto"`` under several (``max_backoff``,
``pay_margin``) and calibrations against plain decoding and fixed depths.

Each set runs as continuous batching at ``--batch`` slots (``tools/spec_continuous.py``, the
server's shape; 1: one request at a time): the configurations take turns in segments of
``batch`` finished rows. Auto's variants share one compiled loop and one cost model (kept on disk
or measured, as ``tools/bench_spec.py`` does): the constants and the calibration are fields of the
traced ``DepthPolicy`` (:func:`dflash_jax.decode.auto.costs.depth_policy`); a variant ending in ``:raw`` takes
the drafter's confidences as acceptance predictions (the identity calibration). Reported per
configuration: decode tokens/s against plain (ratio of sums; in brackets the lowest and highest
ratio of one round of segments), the steps that drafted and the plain steps, and whether every
output equals plain greedy decoding. Results go to a section of ``BENCHMARKS.md``::

    python tools/bench_policy.py                      # 24 + 24 prompts, 256 new tokens, 8 slots: 8:0.05 against 16:0.15
    python tools/bench_policy.py --batch 1 --sets chat:16 --variants 8:0.05,8:0.05:raw --fixed 1,2 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import at_least, int_list, machine, publish  # noqa: E402
from prompts import CHAT_PROMPTS, CODE_PROMPTS, humaneval_chat_prompts  # noqa: E402

SETS = {"chat": lambda: list(CHAT_PROMPTS), "code": lambda: list(CODE_PROMPTS), "humaneval": humaneval_chat_prompts}


def parse_variants(text: str) -> dict:
    """``"16:0.15,8:0.05:raw"`` -> ``{"16 / 0.15": dict(max_backoff=16, pay_margin=0.15), "8 / 0.05 / raw":
    dict(max_backoff=8, pay_margin=0.05, raw=True)}``; ``raw``: the drafter's confidences taken as
    acceptance predictions (the identity calibration) instead of its fitted calibration."""
    from dflash_jax.decode.auto.costs import check_constants
    from dflash_jax.errors import DFlashError

    out = {}
    for item in text.split(","):
        parts = item.split(":")
        raw = parts[2:] == ["raw"]
        try:
            if len(parts) != 2 and not raw:
                raise ValueError
            fields = dict(max_backoff=int(parts[0]), pay_margin=float(parts[1]))
        except ValueError:
            raise SystemExit(f"error: --variants: got {item!r} (expected MAX_BACKOFF:PAY_MARGIN[:raw] such as 16:0.15)") from None
        try:
            check_constants(**fields)
        except DFlashError as e:
            raise SystemExit(f"error: --variants {item}: {e}") from None
        name = f"{fields['max_backoff']} / {fields['pay_margin']}" + (" / raw" if raw else "")
        if name in out:
            raise SystemExit(f"error: --variants: {item!r} given twice")
        out[name] = dict(fields, raw=raw)
    return out


def parse_sets(text: str) -> list[tuple[str, int]]:
    """``"chat:32,humaneval:48"`` -> ``[("chat", 32), ("humaneval", 48)]``; prompts repeat
    cyclically past a set's end."""
    out = []
    for item in text.split(","):
        name, _, count = item.partition(":")
        if name not in SETS or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"error: --sets: got {item!r} (expected NAME:COUNT with NAME in {sorted(SETS)})")
        out.append((name, int(count)))
    return out


def rows(res: dict, configs) -> list[str]:
    s = res["sums"]
    plain = s["plain"]
    out = []
    for v in configs:
        ratio = (s[v]["tokens"] / s[v]["seconds"]) / (plain["tokens"] / plain["seconds"])
        rounds = [(ta / sa) / (tb / sb) for (ta, sa), (tb, sb) in zip(s[v]["per_batch"], plain["per_batch"])]
        drafted = sum(s[v]["widths"])
        equal = s[v]["verdicts"].count("equal")
        out.append(f"| {res['name']} | {'n_max ' + str(v) if isinstance(v, int) else v} | **{ratio:.2f}x** ({min(rounds):.2f}-{max(rounds):.2f}) | {drafted} | "
                   f"{s[v]['steps'] - drafted} | {plain['steps']} | {equal} / {len(s[v]['verdicts'])} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="humaneval:24,chat:24", help="NAME:COUNT,... (chat, code, humaneval); prompts repeat cyclically")
    p.add_argument("--variants", default="8:0.05,16:0.15", help="MAX_BACKOFF:PAY_MARGIN[:raw],... auto variants (raw: the identity calibration)")
    p.add_argument("--fixed", type=int_list, default=[], help="fixed depths to run too, such as 1,2 (default none)")
    p.add_argument("--auto-blocks", type=int_list, default=[], help="auto over shorter blocks too, such as 4,2 (verify widths 1,3 and 1)")
    p.add_argument("--batch", type=at_least(1), default=8, help="slots of continuous batching")
    p.add_argument("--max-new-tokens", type=at_least(1), default=256, help="new tokens per answer (users' answers run to hundreds)")
    p.add_argument("--measure-costs", action="store_true", help="measure auto's cost model again instead of reading it")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    variants, sets = parse_variants(args.variants), parse_sets(args.sets)
    fixed = [*args.fixed, *(f"auto@{k}" for k in args.auto_blocks)]

    import dflash_jax as dj
    from spec_continuous import run_set

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    if any(not 1 <= k < drafter.cfg.block_size for k in args.fixed):
        raise SystemExit(f"error: --fixed: got {args.fixed} (depths from 1 to {drafter.cfg.block_size - 1})")
    if any(not 2 <= k < drafter.cfg.block_size for k in args.auto_blocks):
        raise SystemExit(f"error: --auto-blocks: got {args.auto_blocks} (blocks from 2 to {drafter.cfg.block_size - 1} tokens)")
    bench_args = types.SimpleNamespace(max_new_tokens=args.max_new_tokens, measure_costs=args.measure_costs)
    table = []
    for name, count in sets:
        texts = SETS[name]()
        prompts = [dj.encode_prompt(target, texts[i % len(texts)]) for i in range(count)]
        res = run_set(target, drafter, f"{name} ({count})", prompts, args.batch, bench_args, variants=variants, fixed=fixed)
        table += rows(res, [*fixed, *variants])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = machine()
    cmd = shlex.join(["python", "tools/bench_policy.py", *(sys.argv[1:] if argv is None else argv)])
    text = f"""## Policy constants (`tools/bench_policy.py`)

`{cmd}` ({when}); the default target and its shipped drafter, greedy, {args.max_new_tokens} new tokens, continuous
batching at {args.batch} slot(s), the API's default capacity. Auto's variants are `max_backoff / pay_margin` of its depth
policy (one compiled loop, one cost model; `raw`: the identity calibration). Ratio: decode tokens/s against plain
decoding over the set (in brackets: the lowest and highest ratio of one round of segments).

| set | decoding | against plain | steps that drafted | plain steps | plain decoding's steps | outputs equal to plain greedy |
|---|---|---|---|---|---|---|
{chr(10).join(table)}

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    publish(text, args, "policy", "bench_policy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
