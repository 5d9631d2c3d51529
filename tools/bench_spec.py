"""Adaptive verify depth against every fixed depth and plain decoding, side by side in one run.

For each prompt set (HumanEval asked as chat, and general chat prompts) and batch size, greedy,
the default target and its shipped drafter at the API's default capacity: decode tokens/s of
plain decoding, of DFlash at every fixed ``n_max`` 1..block_size-1 and of ``n_max="auto"``,
each batch run under every configuration in turn (a different one first each time); a batch
above 1 runs as continuous batching (``speclib.py``: a finished row takes the next
prompt at once, as the server does; segments of finished rows alternate); the best
fixed depth chosen per set after the fact; ratios with a bootstrap interval over batches and by
CPU time; tau per configuration, auto's width histogram, plain steps and cost model; whether
every output equals plain greedy decoding (differences at near-ties of the target's logits
reported apart); XLA compilations inside the timed loops (must be 0). A batch is prefilled once
for plain decoding and once with capture, and every configuration starts from a copy.
Results go to a section of ``BENCHMARKS.md`` and the plot to ``docs/results/depth_sweep.png``::

    python tools/bench_spec.py --humaneval 164 --chat 16 --batches 1,8 --max-new-tokens 32
    python tools/bench_spec.py --humaneval 8 --chat 4 --batches 1 --no-write   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import gc
import shlex
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RESULTS, at_least, busy_seconds, int_list, machine, write_section  # noqa: E402
from speclib import compare, compile_all, configs, prefilled, run_config, run_continuous  # noqa: E402

from dflash_jax.assets.prompts import CHAT_PROMPTS, humaneval_chat_prompts  # noqa: E402

def batches(prompts, batch, args):
    """Batches of ``batch`` prompts (sorted by length, so a batch shares a capacity), each with
    the API's default capacity, grouped by capacity."""
    from dflash_jax.arguments import default_max_len

    order = sorted(prompts, key=len) if batch > 1 else prompts
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    groups = [g for g in groups if len(g) == batch]
    by_cap = {}
    for g in groups:
        by_cap.setdefault(default_max_len(g, args.max_new_tokens), []).append(g)
    return sorted(by_cap.items())


def run_set(target, drafter, name, prompts, batch, args) -> dict:
    """Every configuration on every batch of one set; per configuration the sums over batches.
    A batch above 1 runs as continuous batching (:func:`speclib.run_continuous`), as a server runs it."""
    import jax

    if batch > 1:
        return run_continuous(target, drafter, name, prompts, batch, args)

    names = configs(drafter)
    sums = {c: dict(seconds=0.0, cpu=0.0, tokens=0, per_batch=[], passes=0, committed=0, widths=None, steps=0, verdicts=[], compiled=0)
            for c in names}
    cost_models, k = {}, 0
    for capacity, groups in batches(prompts, batch, args):
        prepared = compile_all(target, drafter, groups[0], args, capacity)
        cost_models[capacity] = prepared["cost_model"]
        for g in groups:
            order = names[k % len(names) :] + names[: k % len(names)]  # a different configuration first each time
            k += 1
            recs, states = {}, prefilled(target, prepared, g, args, capacity)
            for _ in range(args.repeats):  # the least disturbed run of each configuration counts
                for c in order:
                    r = run_config(prepared, c, states)
                    if c not in recs or r["seconds"] < recs[c]["seconds"]:
                        recs[c] = r
            for c, r in recs.items():
                s = sums[c]
                s["seconds"] += r["seconds"]
                s["cpu"] += r["cpu"]
                s["tokens"] += r["decode_tokens"]
                s["steps"] += r["steps"]
                s["compiled"] += r["compiled"]
                s["per_batch"].append((r["decode_tokens"], r["seconds"]))
                s["verdicts"] += [compare(p, o) for p, o in zip(recs["plain"]["rows"], r["rows"])]
                if "passes" in r:
                    s["passes"] += r["passes"]
                    s["committed"] += r["committed"]
                    s["widths"] = r["widths"] if s["widths"] is None else [a + b for a, b in zip(s["widths"], r["widths"])]
            print(f"{name} batch {batch} cap {capacity} {k}: " + " ".join(f"{c}={recs[c]['decode_tokens'] / recs[c]['seconds']:.1f}" for c in names),
                  file=sys.stderr, flush=True)
        del prepared
        jax.clear_caches()  # every XLA:CPU executable keeps memory mappings: free this capacity's
        gc.collect()
    return dict(name=name, batch=batch, batches=k, sums=sums, cost_models=cost_models)


def ratio_interval(a: dict, b: dict, seed: int = 0, draws: int = 2000):
    """Bootstrap 95 % interval of the ratio the tables report, (tokens/s of ``a``) / (tokens/s of
    ``b``) with each rate a sum of tokens over a sum of seconds, resampling the batches (their
    ``per_batch`` pairs ``(tokens, seconds)``, in the same order for ``a`` and ``b``) with
    replacement: the statistic of the point figure (earlier versions resampled the mean of the
    per-batch rates, which weighs batches equally, and a figure could fall outside its interval)."""
    pa, pb = np.array(a["per_batch"], float), np.array(b["per_batch"], float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pa), (draws, len(pa)))

    def rate(p):
        return p[idx, 0].sum(1) / p[idx, 1].sum(1)

    r = np.sort(rate(pa) / rate(pb))
    return float(r[int(0.025 * draws)]), float(r[int(0.975 * draws)])


def summary_rows(res, names) -> tuple[str, dict]:
    s = res["sums"]
    tps = {c: s[c]["tokens"] / s[c]["seconds"] for c in names}
    fixed = [c for c in names if isinstance(c, int)]
    best = max(fixed, key=lambda c: tps[c])
    lo, hi = ratio_interval(s["auto"], s["plain"])
    blo, bhi = ratio_interval(s["auto"], s[best])
    eq = [s[c]["verdicts"].count("equal") for c in names[1:]]
    mism = sum(s[c]["verdicts"].count("MISMATCH") for c in names[1:])
    ties = sum(s[c]["verdicts"].count("tie") for c in names[1:])
    tau = {c: s[c]["committed"] / max(s[c]["passes"], 1) for c in names[1:]}
    w = s["auto"]["widths"] or []
    plain_steps = s["auto"]["steps"] - sum(w)
    cpu = {c: s[c]["tokens"] / s[c]["cpu"] for c in names}
    line = (f"| {res['name']} | {res['batch']} | {res['batches']} | {tps['plain']:.1f} | " + " | ".join(f"{tps[c]:.1f}" for c in fixed)
            + f" | **{tps['auto']:.1f}** | n_max {best} | **{tps['auto'] / tps[best]:.2f}x** ({blo:.2f}-{bhi:.2f}) | "
            f"**{tps['auto'] / tps['plain']:.2f}x** ({lo:.2f}-{hi:.2f}) |")
    best_cpu = max(fixed, key=lambda c: cpu[c])
    detail = dict(tps=tps, cpu_ratios=(cpu["auto"] / cpu[best_cpu], best_cpu, cpu["auto"] / cpu["plain"]), best=best, tau=tau, widths=w, plain_steps=plain_steps, equal=min(eq), ties=ties, mismatches=mism,
                  compiled=sum(s[c]["compiled"] for c in names), outputs=len(s["auto"]["verdicts"]))
    return line, detail


def plot(results, names, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        s = res["sums"]
        fixed = [c for c in names if isinstance(c, int)]
        ax.plot(fixed, [s[c]["tokens"] / s[c]["seconds"] for c in fixed], marker="o", label="fixed n_max")
        ax.axhline(s["auto"]["tokens"] / s["auto"]["seconds"], color="C3", label="auto")
        ax.axhline(s["plain"]["tokens"] / s["plain"]["seconds"], color="grey", ls="--", label="plain")
        ax.set(xlabel="n_max (drafts verified per step)", ylabel="decode tokens/s", title=f"{res['name']}, batch {res['batch']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--humaneval", type=at_least(0), default=48, help="the first N HumanEval prompts (164: all)")
    p.add_argument("--chat", type=at_least(0), default=len(CHAT_PROMPTS), help="the first N chat prompts")
    p.add_argument("--batches", type=int_list, default=[1, 8], help="batch sizes, such as 1,8")
    p.add_argument("--max-new-tokens", type=at_least(1), default=48)
    p.add_argument("--repeats", type=at_least(1), default=1, help="runs of each configuration per batch, alternating; the fastest counts")
    p.add_argument("--measure-costs", action="store_true", help="measure auto's cost models again instead of reading them")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md and the plot alone")
    args = p.parse_args(argv)
    if not args.humaneval and not args.chat:
        p.error("arguments --humaneval and --chat: both 0, so no prompt is left to run")

    import dflash_jax as dj

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    sets = {}
    if args.humaneval:
        sets["HumanEval"] = humaneval_chat_prompts()[: args.humaneval]
    if args.chat:
        sets["chat"] = CHAT_PROMPTS[: args.chat]
    enc = {k: [dj.encode_prompt(target, t) for t in v] for k, v in sets.items()}
    names = configs(drafter)
    busy0, t0 = busy_seconds(), time.perf_counter()
    results = [run_set(target, drafter, name, prompts, int(b), args) for b in args.batches for name, prompts in enc.items()]
    wall = time.perf_counter() - t0
    busy = None if busy0 is None else (busy_seconds() - busy0) / wall
    body = section(results, names, args, argv, wall, busy, drafter)
    print(body)
    if not args.no_write:
        plot(results, names, RESULTS / "depth_sweep.png")
        write_section(Path(args.output), "depth", body, tool="bench_spec")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def section(results, names, args, argv, wall, busy, drafter) -> str:
    m = machine()
    cmd = "python tools/bench_spec.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fixed = [c for c in names if isinstance(c, int)]
    lines, details = zip(*[summary_rows(r, names) for r in results])
    extra = []
    for r, d in zip(results, details):
        w = " ".join(f"{i}:{c}" for i, c in enumerate(d["widths"]))
        taus = ", ".join(f"{c} {d['tau'][c]:.2f}" for c in names[1:])
        costs = "; ".join(f"capacity {cap}: " + " ".join(f"{w}:{1000 * c:.0f}" for w, c in zip(cm.widths, cm.step_cost[0])) + f" / plain {1000 * cm.plain_cost[0]:.0f}"
                          for cap, cm in sorted(r["cost_models"].items()))
        extra.append(f"- {r['name']}, batch {r['batch']}: auto's widths (drafts verified: steps) {w}, plain steps {d['plain_steps']}; "
                     f"tau {taus}; outputs equal to plain greedy: {d['equal']} / {d['outputs']} at worst per configuration, "
                     f"{d['ties']} near-ties, {d['mismatches']} mismatches; compilations in the timed loops: {d['compiled']}. "
                     f"By this process's CPU time instead of wall time: auto / best fixed (n_max {d['cpu_ratios'][1]}) "
                     f"{d['cpu_ratios'][0]:.2f}x, auto / plain {d['cpu_ratios'][2]:.2f}x. "
                     f"auto's cost model (ms per step, widths 0..{len(fixed)}, then the plain step): {costs}.")
    load = "" if busy is None else f" Other processes and this one kept {busy:.1f} of the {m['cores']} cores busy on average."
    return f"""## Adaptive depth: plain, fixed n_max 1..{len(fixed)} and auto, side by side

`{cmd.strip()}` ({date}); the default target (SmolLM2-135M-Instruct Q4_1, float32) and its shipped drafter
`{Path(drafter.source).name}`; greedy, {args.max_new_tokens} new tokens, the API's default capacity per batch, the fastest of
{args.repeats} run(s) per configuration and batch; {wall / 60:.0f} minutes.{load}
Decode tokens/s (sums over the batches; decode time excludes compilation and prefill); the best fixed depth is
chosen per row after the fact; ratios of those rates, with a bootstrap 95 % interval of the same ratio over batches. A batch above 1 runs as
continuous batching, as the server does (`tools/speclib.py`): each configuration keeps its slots busy, a
finished row taking the next prompt of the set, until it has finished as many rows as the set has prompts; there
"batches" counts the segments of that many finished rows in which the configurations took turns.

| prompts | batch | batches | plain | """ + " | ".join(f"n_max {c}" for c in fixed) + """ | auto | best fixed | auto / best fixed | auto / plain |
|---|---|---|---|""" + "---|" * len(fixed) + """---|---|---|---|
""" + "\n".join(lines) + "\n\n" + "\n".join(extra) + f"""

Plot: `docs/results/depth_sweep.png` (tokens/s against n_max, auto and plain as lines); calibration of the
drafter's confidences: `docs/results/calibration.png` (`dflash-jax calibrate-depth --plot docs/results/calibration.png`).

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""


if __name__ == "__main__":
    sys.exit(main())
