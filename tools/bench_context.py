"""Decode and prefill speed against the live context and the allocated capacity (default pair).

For live contexts of about 128, 1k, 4k and 7.5k tokens (a raw continuation of code: HumanEval
prompts concatenated), plain and DFlash decoding of the embedded SmolLM2-135M-Instruct and its
shipped drafter run at capacity "live + 256" and at capacity 8192, alternating in one process
(`--repeats` rounds, medians). It reports decode tokens/s, the 8192/tight ratio, prefill tokens/s,
and for plain decoding the step time against what its memory traffic predicts: the weights plus
``L`` times the KV bytes per token, at the bandwidth the 128-token step reaches. A batch of 8 rows
of mixed lengths (32 to 4k) runs the same way. Figures go to ``BENCHMARKS.md`` (machine, command,
date) and a plot to ``tools/results/bench_context.png``::

    python tools/bench_context.py                 # ~15 min on a 2-core CPU
    python tools/bench_context.py --lengths 128,1024 --repeats 1 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, write_section  # noqa: E402
from prompts import humaneval_prompts  # noqa: E402

BIG = 8192
MIXED = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def context_ids(target, n: int) -> list[int]:
    """``n`` token ids of raw Python source (HumanEval prompts, concatenated and repeated)."""
    doc = "\n\n".join(humaneval_prompts())
    ids = target.tokenizer.encode(doc, add_bos=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def weight_bytes(params) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def kv_bytes_per_token(cfg) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize


def run_cases(target, drafter, cases, new_tokens: int, repeats: int) -> dict:
    """``{(name, mode, capacity): [stats, ...]}`` with the cases run alternately, ``repeats`` rounds."""
    import dflash_jax as dj

    out: dict = {}
    for r in range(repeats):
        for name, prompts in cases:
            longest = max(len(p) for p in prompts)
            for cap in (min(longest + 256, BIG), BIG):
                for mode in ("plain", "dflash"):
                    res = dj.generate(target, prompts, max_new_tokens=new_tokens, max_len=cap, drafter=drafter if mode == "dflash" else None)
                    out.setdefault((name, mode, cap), []).append(res.stats)
                    print(f"round {r} {name:>6} {mode:>6} cap {cap:5d}: decode {res.stats['decode_tokens_per_s']:7.2f} tok/s, "
                          f"prefill {res.stats['prefill_tokens_per_s']:8.1f} tok/s", flush=True)
    return out


def median(stats: list, key: str) -> float:
    return statistics.median(s[key] for s in stats)


def table(runs: dict, cases, w_bytes: int, kv_tok: int) -> tuple[str, list]:
    """Markdown table and plot rows from :func:`run_cases`' results."""
    rows, plot = [], []
    base = None
    for name, prompts in cases:
        longest = max(len(p) for p in prompts)
        tight = min(longest + 256, BIG)
        cells = {}
        for mode in ("plain", "dflash"):
            t, b = median(runs[(name, mode, tight)], "decode_tokens_per_s"), median(runs[(name, mode, BIG)], "decode_tokens_per_s")
            cells[mode] = (t, b)
        prefill = median(runs[(name, "plain", BIG)], "prefill_tokens_per_s")
        tau = median(runs[(name, "dflash", BIG)], "tau")
        step_ms = 1000.0 * len(prompts) / cells["plain"][1]
        if base is None and len(prompts) == 1:
            base = (step_ms, longest)
        predicted = base[0] * (w_bytes + longest * kv_tok) / (w_bytes + base[1] * kv_tok) if base else float("nan")
        rows.append(f"| {name} | {tight} | {cells['plain'][0]:.2f} | {cells['plain'][1]:.2f} | {cells['plain'][1] / cells['plain'][0]:.2f}x "
                    f"| {cells['dflash'][0]:.2f} | {cells['dflash'][1]:.2f} | {cells['dflash'][1] / cells['dflash'][0]:.2f}x "
                    f"| {tau:.2f} | {cells['dflash'][1] / cells['plain'][1]:.2f}x | {prefill:.0f} | {step_ms:.1f} | "
                    + (f"{step_ms / predicted:.2f}x |" if len(prompts) == 1 else f"n/a ({len(prompts)} rows) |"))
        plot.append((name, longest, cells, prefill))
    head = ("| live context | tight capacity | plain tok/s (tight) | plain tok/s (8192) | 8192/tight | DFlash tok/s (tight) "
            "| DFlash tok/s (8192) | 8192/tight | tau | DFlash/plain (8192) | prefill tok/s | plain step ms (8192) | step / memory-traffic prediction |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows), plot


def save_plot(plot, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = [p for p in plot if p[0] != "mixed8"]
    xs = [p[1] for p in single]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, color in (("plain", "tab:blue"), ("dflash", "tab:orange")):
        ax.plot(xs, [p[2][mode][0] for p in single], "o-", color=color, label=f"{mode}, capacity live+256")
        ax.plot(xs, [p[2][mode][1] for p in single], "s--", color=color, label=f"{mode}, capacity 8192")
    ax.set_xscale("log")
    ax.set_xlabel("live context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("SmolLM2-135M float32, batch 1: speed follows the live context")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128,1024,4096,7500", help="live contexts in tokens (comma-separated)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens decoded per run (default 48)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-mixed", action="store_true", help="skip the batch of 8 mixed lengths")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the figures only")
    args = p.parse_args(argv)

    import dflash_jax as dj

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    lengths = [int(x) for x in args.lengths.split(",")]
    cases = [(str(n), [context_ids(target, n)]) for n in lengths]
    if not args.no_mixed:
        cases.append(("mixed8", [context_ids(target, n) for n in MIXED]))
    runs = run_cases(target, drafter, cases, args.new_tokens, args.repeats)
    text, plot = table(runs, cases, weight_bytes(target.params), kv_bytes_per_token(target.cfg))
    print(text)
    if args.no_write:
        return 0
    out = REPO / "tools" / "results"
    save_plot(plot, out / "bench_context.png")
    (out / "bench_context.json").write_text(json.dumps({f"{k[0]}/{k[1]}/{k[2]}": v for k, v in runs.items()}, indent=1))
    m = machine()
    body = (f"## Live context against capacity (SmolLM2-135M + shipped drafter, float32)\n\n"
            f"- date: {datetime.date.today()}; machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; jax {m['jax']}\n"
            f"- command: `python tools/{Path(__file__).name} {shlex.join(argv if argv is not None else sys.argv[1:])}`\n"
            f"- {args.new_tokens} new tokens per run, greedy, medians of {args.repeats} alternating rounds; 'mixed8' is a batch of 8 "
            f"rows of {', '.join(map(str, MIXED))} prompt tokens (live context = its longest row); plot: `tools/results/bench_context.png`\n\n"
            + text + "\n")
    write_section(Path(args.output), "context", body, tool="bench_context")
    return 0


if __name__ == "__main__":
    sys.exit(main())
