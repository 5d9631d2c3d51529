"""DFlash speculative decoding against plain decoding, measured side by side in one run.

For each prompt (HumanEval asked as chat, and general chat prompts), greedy, the same target and
capacity: plain decode tokens/s, DFlash decode tokens/s, tau (tokens committed per verify step,
bonus included), per-position acceptance and the tau distribution; whether every speculative
output equals the plain greedy output (differences only at near-ties of the target's logits are
reported separately); an ``--n-max`` sweep; the cost of one verify pass of B tokens relative to
one decode step for B = 1..16; and the number of XLA compilations after warm-up (must be 0).
Results go to a section of ``BENCHMARKS.md`` and plots to ``tools/results/``::

    python tools/bench_spec.py                       # shipped drafter, all 164 HumanEval + 16 chat prompts
    python tools/bench_spec.py --limit 20 --sweep 1,3,7,15 --no-write
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
from benchlib import machine, write_section  # noqa: E402
from prompts import CHAT_PROMPTS, humaneval_chat_prompts  # noqa: E402

TIE_GAP = 1e-3  # a first difference at a step whose top-2 logit gap is below this is a near-tie
compiles = [0]  # XLA compilations inside prefill + generate of the measured runs


def run_one(target, drafter, ids, args, n_max, greedy):
    """Plain and DFlash decoding of one prompt: returns dicts with ids, gaps, decode seconds, stats."""
    import jax

    from dflash_jax import decode
    from dflash_jax.compile_count import count_compilations
    from dflash_jax.decoding import Decoding, Params

    cfg, params = target.cfg, target.params
    out = {}
    for mode in ("plain", "dflash"):
        with count_compilations() as compiled:  # prefill + generate only
            if mode == "plain":
                static, weights = Decoding(cfg, sampling=greedy), Params(params)
            else:
                static, weights = Decoding(cfg, drafter.cfg, greedy, n_max=n_max), Params(params, drafter.params)
            st = decode.init_state(static, [ids], args.max_len, args.max_new_tokens, target.eos_ids)
            st = decode.prefill(weights, st, static, args.chunk_size, max_prompt_len=len(ids))
            jax.block_until_ready(st)
            t0 = time.perf_counter()
            st = decode.generate(weights, st, static)
            jax.block_until_ready(st)
            dt = time.perf_counter() - t0
            compiles[0] += compiled()
        tokens, gaps, length = jax.device_get((st.tokens, st.gaps, st.length))  # slice on the host
        n = int(length[0]) - len(ids)
        rec = dict(ids=[int(t) for t in tokens[0, len(ids) : len(ids) + n]],
                   gaps=[float(g) for g in gaps[0, len(ids) : len(ids) + n]], seconds=dt, decode_tokens=n - 1)
        if mode == "dflash":
            sp = jax.device_get(st.speculative)
            rec.update(steps=int(sp.verify_steps[0]), committed=int(jax.device_get(st.committed)[0]),
                       per_pos=[int(x) for x in sp.accepted_per_position[0]])
        out[mode] = rec
    return out


def compare(plain, dflash) -> str:
    """``"equal"``, ``"tie"`` (first difference at a near-tie) or ``"MISMATCH"``."""
    a, b = plain["ids"], dflash["ids"]
    if a == b:
        return "equal"
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    gap = plain["gaps"][i] if i < len(plain["gaps"]) else 0.0
    return "tie" if gap < TIE_GAP else "MISMATCH"


def verify_cost(target, context: int, repeats: int = 7) -> list[float]:
    """Median seconds of one target pass over B = 1..16 tokens on a cache of ``context`` tokens."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.registry import module_for

    cfg, params = target.cfg, target.params
    mod = module_for(cfg)

    @jax.jit
    def step(params, cache, toks, pos):
        h, cache, _ = mod.forward_hidden(params, cfg, toks, pos, cache)
        return mod.lm_head(params, cfg, h), cache

    times = []
    for b in range(1, 17):
        cache = mod.init_cache(cfg, 1, context + 32)
        toks = jnp.ones((1, b), jnp.int32)
        pos = context + jnp.arange(b, dtype=jnp.int32)[None]
        jax.block_until_ready(step(params, cache, toks, pos))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, cache, toks, pos))
            ts.append(time.perf_counter() - t0)
        times.append(statistics.median(ts))
    return times


def propose_cost(target, drafter, ids, args, n_max, repeats: int = 7) -> float:
    """Median seconds of one jitted propose (drafter forward + LM head over the block)."""
    import jax

    from dflash_jax import decode, speculative
    from dflash_jax.decoding import Decoding, Params

    static, weights = Decoding(target.cfg, drafter.cfg, n_max=n_max), Params(target.params, drafter.params)
    st = decode.init_state(static, [ids], args.max_len, args.max_new_tokens)
    st = decode.prefill(weights, st, static, args.chunk_size)
    jax.block_until_ready(speculative.propose_block(weights, st, static))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(speculative.propose_block(weights, st, static))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def summarize(name, results, n_max):
    steps = sum(r["dflash"]["steps"] for r in results)
    committed = sum(r["dflash"]["committed"] for r in results)
    per_pos = [sum(r["dflash"]["per_pos"][i] for r in results) / max(steps, 1) for i in range(n_max)]
    taus = [r["dflash"]["committed"] / r["dflash"]["steps"] for r in results if r["dflash"]["steps"]]
    plain_tps = sum(r["plain"]["decode_tokens"] for r in results) / sum(r["plain"]["seconds"] for r in results)
    spec_tps = sum(r["dflash"]["decode_tokens"] for r in results) / sum(r["dflash"]["seconds"] for r in results)
    verdicts = [compare(r["plain"], r["dflash"]) for r in results]
    return dict(name=name, prompts=len(results), tau=committed / max(steps, 1), tau_per_prompt=statistics.mean(taus) if taus else 0,
                per_pos=per_pos, plain_tps=plain_tps, spec_tps=spec_tps, speedup=spec_tps / plain_tps,
                equal=verdicts.count("equal"), ties=verdicts.count("tie"), mismatches=verdicts.count("MISMATCH"),
                steps_hist=[r["dflash"]["committed"] / max(r["dflash"]["steps"], 1) for r in results])


def plots(sets, sweep, out_dir: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    for s in sets:
        ax[0].plot(range(1, len(s["per_pos"]) + 1), s["per_pos"], marker="o", label=s["name"])
        ax[1].hist(s["steps_hist"], bins=20, alpha=0.6, label=s["name"])
    ax[0].set(xlabel="draft position", ylabel="acceptance rate", title="per-position acceptance")
    ax[1].set(xlabel="tau per prompt", ylabel="prompts", title="tau distribution")
    ax[0].legend(), ax[1].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=110)
    if sweep:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        ns = [n for n, _ in sweep]
        ax[0].plot(ns, [s["tau"] for _, s in sweep], marker="o")
        ax[1].plot(ns, [s["speedup"] for _, s in sweep], marker="o")
        ax[0].set(xlabel="n_max", ylabel="tau", title="tau vs n_max")
        ax[1].set(xlabel="n_max", ylabel="DFlash / plain decode tok/s", title="speedup vs n_max")
        fig.tight_layout()
        fig.savefig(out_dir / "n_max_sweep.png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="drafter folder (default: the one shipped for the target)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024, help="capacity, fixed for all prompts (one compilation)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--n-max", type=int, default=None, help="draft depth for the main run (default block_size - 1)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    p.add_argument("--sets", default="humaneval,chat")
    p.add_argument("--sweep", default="1,2,3,5,7,11,15", help="n_max values, run on --sweep-prompts HumanEval prompts")
    p.add_argument("--sweep-prompts", type=int, default=24)
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md and the plots alone")
    args = p.parse_args(argv)

    import dflash_jax as dj
    from dflash_jax.sampling import SamplingConfig

    target = dj.load_target(args.target, dtype=args.dtype)
    drafter = dj.load_drafter(args.draft, target) if args.draft else dj.shipped_drafter(target)
    if drafter is None:
        print("error: no drafter ships for this target (expected --draft PATH)", file=sys.stderr)
        return 2
    n_max = args.n_max or drafter.n_max or drafter.cfg.block_size - 1
    greedy = SamplingConfig()
    texts = {}
    if "humaneval" in args.sets:
        texts["HumanEval"] = humaneval_chat_prompts()
    if "chat" in args.sets:
        texts["chat"] = list(CHAT_PROMPTS)
    enc = {k: [dj.encode_prompt(target, t) for t in v[: args.limit]] for k, v in texts.items()}

    first = next(iter(enc.values()))[0]
    run_one(target, drafter, first, args, n_max, greedy)  # warm-up: compiles everything
    sets = []
    compiles[0] = 0
    for name, prompts in enc.items():
        results = []
        for i, ids in enumerate(prompts):
            results.append(run_one(target, drafter, ids, args, n_max, greedy))
            r = results[-1]
            print(f"{name} {i + 1}/{len(prompts)}: tau {r['dflash']['committed'] / max(r['dflash']['steps'], 1):.2f} "
                  f"plain {r['plain']['decode_tokens'] / r['plain']['seconds']:.1f} tok/s "
                  f"dflash {r['dflash']['decode_tokens'] / r['dflash']['seconds']:.1f} tok/s {compare(r['plain'], r['dflash'])}",
                  file=sys.stderr)
        sets.append(summarize(name, results, n_max))
    main_compiles = compiles[0]
    sweep = []
    for n in [int(x) for x in args.sweep.split(",") if x] if args.sweep else []:
        if not 1 <= n <= drafter.cfg.block_size - 1:
            continue
        prompts = enc.get("HumanEval", next(iter(enc.values())))[: args.sweep_prompts]
        run_one(target, drafter, prompts[0], args, n, greedy)
        sweep.append((n, summarize(f"n_max={n}", [run_one(target, drafter, ids, args, n, greedy) for ids in prompts], n)))
        print(f"sweep n_max={n}: tau {sweep[-1][1]['tau']:.2f} speedup {sweep[-1][1]['speedup']:.2f}", file=sys.stderr)
    costs = verify_cost(target, context=256)
    layouts = {"per-layer" if isinstance(drafter.params["layers"], tuple) else "stacked": drafter}
    if "per-layer" in layouts:  # the layout load_drafter picks on CPU, against the stacked one, alternating
        layouts["stacked"] = dj.load_drafter(drafter.source, target, layers="stacked")
    runs = {name: [] for name in layouts}
    for _ in range(3):
        for name, d in layouts.items():
            runs[name].append(propose_cost(target, d, first, args, n_max))
    propose_s = {name: min(ts) for name, ts in runs.items()}
    draft_s = next(iter(propose_s.values()))
    if not args.no_write:
        plots(sets, sweep, REPO / "tools" / "results")

    m = machine()
    cmd = "python tools/bench_spec.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = "\n".join(
        f"| {s['name']} | {s['prompts']} | **{s['tau']:.2f}** | {s['plain_tps']:.1f} | {s['spec_tps']:.1f} | **{s['speedup']:.2f}x** | "
        f"{s['equal']} / {s['ties']} / {s['mismatches']} |" for s in sets)
    pos = "\n".join(f"| {s['name']} | " + " | ".join(f"{x:.2f}" for x in s["per_pos"]) + " |" for s in sets)
    sweep_rows = "\n".join(f"| {n} | {s['tau']:.2f} | {s['plain_tps']:.1f} | {s['spec_tps']:.1f} | {s['speedup']:.2f}x |" for n, s in sweep)
    cost_row = " | ".join(f"{c / costs[0]:.2f}" for c in costs)
    dc = drafter.cfg
    layout_note = ", ".join(f"draft layers {k}: {1000 * v:.1f} ms" for k, v in propose_s.items())
    vocab = f"draft vocabulary {dc.draft_vocab_size}" if dc.draft_vocab_size else "full draft vocabulary"
    body = f"""## DFlash vs plain decoding: {Path(target.source).name}, {args.dtype}, drafter `{Path(drafter.source).name}`

`{cmd.strip()}` ({date}); greedy, {args.max_new_tokens} new tokens, batch 1, n_max {n_max}, capacity {args.max_len};
drafter: {dc.num_hidden_layers} layers, block size {dc.block_size}, {vocab}.
Plain and DFlash runs alternate prompt by prompt in one process; decode time excludes prefill and compilation.

| prompts | n | tau | plain tok/s | DFlash tok/s | speedup | outputs equal / near-tie / mismatch |
|---|---|---|---|---|---|---|
{rows}

Per-position acceptance (fraction of verify steps in which draft position i was accepted):

| set | """ + " | ".join(str(i + 1) for i in range(n_max)) + """ |
|---|""" + "---|" * n_max + f"""
{pos}

n_max sweep (first {args.sweep_prompts} HumanEval prompts):

| n_max | tau | plain tok/s | DFlash tok/s | speedup |
|---|---|---|---|---|
{sweep_rows}

Cost of one target pass over B tokens relative to one decode step (B = 1..16, 256 tokens of context):
{cost_row} (B = 1 takes {1000 * costs[0]:.1f} ms). One propose (drafter + LM head over {n_max} draft slots)
takes {1000 * draft_s:.1f} ms = {draft_s / costs[0]:.2f} decode steps ({layout_note}). A DFlash step costs about
verify(n_max + 1) + propose decode steps and commits tau tokens.

XLA compilations inside prefill and generate of the measured runs after warm-up: **{main_compiles}**.
Plots: `tools/results/acceptance.png`, `tools/results/n_max_sweep.png`.

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    print(body)
    if not args.no_write:
        write_section(Path(args.output), f"{Path(target.source).name} {args.dtype}", body, tool="bench_spec")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
