"""Serving workloads a user would try on ``dflash-jax serve`` (its defaults: the embedded default
pair, DFlash), each measured against the same requests sent one by one.

* ``mixed``: ``--requests`` chat requests (default 8 and 16, :data:`prompts.CHAT_PROMPTS`), every
  other one greedy and the others sampled (temperature 0.7, top-p 0.9, a seed each), all sent at
  once, against the same requests sent one after the other; the two schedules alternate
  (``--reps`` pairs, the order flipping each pair) and the figure is the median ratio of their
  throughputs (completion tokens over the wall time of the whole schedule). Each answer is also
  checked: a greedy request answers the same text at once and alone, a seeded one too.

* ``prefix``: a two-turn chat whose system prompt is about 1.5k tokens (the start of this
  project's README, a new session line each repetition so that every first turn is cold), on a
  server with ``--max-len 2048`` and its default prefix cache, against the same server with
  ``--prefix-cache-mb 0``: the time to the first streamed token of each turn, the cached tokens
  the server reports, the DFlash acceptance (tau) of each answer and whether both servers answer
  the same (greedy).

* ``rows``: many short rows against few long ones at one memory budget. Two servers with
  ``--max-len 2048 --max-batch 64`` and the same ``--kv-cache-mb`` (what ``--rows-budget`` unpaged rows
  of 2048 tokens hold, default 4), one ``--kv-layout rows`` (it can hold only that many rows) and
  one ``--kv-layout paged``: ``--short`` short chat requests (``--max-tokens`` each) sent at once,
  then 4 long ones (a 1.5k-token prompt each). Reported: the most rows running at once (polled
  from ``/metrics``), the wall time and throughput of each schedule, and whether both answer the
  same (greedy).

With ``--baseline REV`` a second server (``mixed`` only), started from a git worktree of ``REV`` (e.g. the commit
before per-row sampling, where a request whose settings differ from the running batch's waited
for it to drain), answers the same schedules in the same alternation.

    python tools/bench_workloads.py                       # writes its section of BENCHMARKS.md
    python tools/bench_workloads.py --baseline 6e7ea11 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from benchlib import free_port, int_list, machine, publish, start, stop  # noqa: E402

from dflash_jax.assets.prompts import CHAT_PROMPTS  # noqa: E402

SAMPLED = dict(temperature=0.7, top_p=0.9)


def requests(n: int) -> list[dict]:
    """``n`` chat requests, every other one greedy, the others sampled with a seed each."""
    out = []
    for i in range(n):
        kind = dict(temperature=0.0) if i % 2 == 0 else dict(SAMPLED, seed=1000 + i)
        out.append(dict(messages=[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}], **kind))
    return out


async def _schedule(url: str, model: str, reqs: list[dict], max_tokens: int, together: bool) -> dict:
    """Sends ``reqs`` all at once (``together``) or one after another: ``{wall, tokens, texts}``."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=1800)

    async def one(r):
        out = await client.chat.completions.create(model=model, max_tokens=max_tokens, **r)
        return out.choices[0].message.content, out.usage.completion_tokens

    t0 = time.perf_counter()
    if together:
        got = await asyncio.gather(*(one(r) for r in reqs))
    else:
        got = [await one(r) for r in reqs]
    wall = time.perf_counter() - t0
    await client.close()
    return dict(wall=wall, tokens=sum(n for _, n in got), texts=[t for t, _ in got])


def schedule(s: dict, reqs: list[dict], max_tokens: int, together: bool) -> dict:
    return asyncio.run(_schedule(s["url"], s["model"], reqs, max_tokens, together))


def mixed(srv: dict, n: int, max_tokens: int, reps: int) -> dict:
    """The ``mixed`` workload (module docstring) on every server: ``{server: figures}``."""
    reqs = requests(n)
    for s in srv.values():  # unmeasured: whatever the first batch shapes compile
        schedule(s, reqs, max_tokens, True)
        schedule(s, reqs[:1], max_tokens, False)
    runs = {name: dict(together=[], alone=[]) for name in srv}
    for rep in range(reps):
        order = [(name, mode) for name in srv for mode in ("together", "alone")]
        for name, mode in (order if rep % 2 == 0 else order[::-1]):
            runs[name][mode].append(schedule(srv[name], reqs, max_tokens, mode == "together"))
            print(f"{name} n={n} {mode}: {runs[name][mode][-1]['wall']:.1f} s", flush=True)
    out = {}
    for name, r in runs.items():
        tput = {m: np.array([x["tokens"] / x["wall"] for x in r[m]]) for m in r}
        same = [a == b for t, s in zip(r["together"], r["alone"]) for a, b in zip(t["texts"], s["texts"])]
        out[name] = dict(requests=n, together_tok_s=float(np.median(tput["together"])), alone_tok_s=float(np.median(tput["alone"])),
                         ratio=float(np.median(tput["together"] / tput["alone"])), same_answers=f"{sum(same)}/{len(same)}",
                         tokens=int(np.median([x["tokens"] for x in r["together"]])))
    return out


def system_prompt(rep: int) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")[:4600]
    return f"Session {rep}. You answer questions about this project; its documentation follows.\n\n{text}"


async def _turn(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat turn: ``{ttft, text, cached, prompt_tokens, tau}``."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=1800)
    t0, ttft, text, usage, spec = time.perf_counter(), None, [], None, None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(ch.choices[0].delta.content)
        usage = ch.usage or usage
        spec = getattr(ch, "speculative", None) or spec
    await client.close()
    return dict(ttft=ttft, text="".join(text), cached=usage.prompt_tokens_details.cached_tokens, prompt_tokens=usage.prompt_tokens,
                tau=(spec or {}).get("tau"))


def prefix(srv: dict, max_tokens: int, reps: int) -> dict:
    """The ``prefix`` workload (module docstring): ``{server: per-turn medians}``."""
    questions = ["What does the tree verification do?", "And how is the depth chosen under auto?"]
    runs = {name: [] for name in srv}
    for rep in range(reps + 1):  # the first repetition is unmeasured: it compiles the prompt's chunk shapes
        for name in (list(srv) if rep % 2 == 0 else list(srv)[::-1]):
            s, messages, turns = srv[name], [{"role": "system", "content": system_prompt(rep)}], []
            for q in questions:
                messages.append({"role": "user", "content": q})
                turns.append(asyncio.run(_turn(s["url"], s["model"], messages, max_tokens)))
                messages.append({"role": "assistant", "content": turns[-1]["text"]})
            if rep:
                runs[name].append(turns)
            print(f"{name} rep {rep}: " + ", ".join(f"ttft {t['ttft']:.2f} s cached {t['cached']}/{t['prompt_tokens']}" for t in turns), flush=True)
    names = list(srv)
    out = {}
    for name, r in runs.items():
        out[name] = dict(turns=[dict(ttft=float(np.median([x[i]["ttft"] for x in r])), cached=int(np.median([x[i]["cached"] for x in r])),
                                     prompt_tokens=int(np.median([x[i]["prompt_tokens"] for x in r])),
                                     tau=float(np.median([x[i]["tau"] or 0 for x in r]))) for i in range(len(questions))],
                         second_to_first=float(np.median([x[1]["ttft"] / x[0]["ttft"] for x in r])))
    same = [a[i]["text"] == b[i]["text"] for a, b in zip(runs[names[0]], runs[names[-1]]) for i in range(len(questions))]
    out["same_answers"] = f"{sum(same)}/{len(same)}"
    return out


async def _peak_rows(url: str, done: asyncio.Event) -> int:
    """The most ``dflash_running_requests`` seen on ``url``'s ``/metrics`` until ``done``."""
    import urllib.request

    def read() -> str:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return r.read().decode()

    peak = 0
    while not done.is_set():
        for line in (await asyncio.to_thread(read)).splitlines():
            if line.startswith("dflash_running_requests "):
                peak = max(peak, int(float(line.split()[1])))
        await asyncio.sleep(0.1)
    return peak


async def _rows_schedule(s: dict, reqs: list[dict], max_tokens: int) -> dict:
    done = asyncio.Event()
    watcher = asyncio.create_task(_peak_rows(s["url"], done))
    out = await _schedule(s["url"], s["model"], reqs, max_tokens, True)
    done.set()
    return dict(out, peak=await watcher)


def rows(srv: dict, n_short: int, max_tokens: int, reps: int) -> dict:
    """The ``rows`` workload (module docstring): ``{server: {short: figures, long: figures}}``."""
    short = [dict(messages=[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}], temperature=0.0) for i in range(n_short)]
    long = [dict(messages=[{"role": "system", "content": system_prompt(100 + i)}, {"role": "user", "content": "Summarise it."}],
                 temperature=0.0) for i in range(4)]
    runs = {name: dict(short=[], long=[]) for name in srv}
    for rep in range(reps + 1):  # the first repetition is unmeasured: it compiles the batch and prompt shapes
        for name in (list(srv) if rep % 2 == 0 else list(srv)[::-1]):
            for kind, reqs in (("short", short), ("long", long)):
                r = asyncio.run(_rows_schedule(srv[name], reqs, max_tokens))
                print(f"{name} rep {rep} {kind}: {r['wall']:.1f} s, peak {r['peak']} rows", flush=True)
                if rep:
                    runs[name][kind].append(r)
    out = {}
    for name, r in runs.items():
        out[name] = {kind: dict(requests=len(x[0]["texts"]), peak=max(y["peak"] for y in x), wall=float(np.median([y["wall"] for y in x])),
                                tok_s=float(np.median([y["tokens"] / y["wall"] for y in x])), texts=x[0]["texts"]) for kind, x in r.items()}
    a, b = list(out.values())
    out["same_answers"] = {k: f"{sum(p == q for p, q in zip(a[k]['texts'], b[k]['texts']))}/{len(a[k]['texts'])}" for k in ("short", "long")}
    return out


def servers(spec: list[tuple[str, str | None, list[str]]], logs: Path) -> tuple[dict, list]:
    """``{name: server}`` of ``(name, revision or None for this tree, extra serve options)``, one
    after the other (a revision serves from a git worktree of it); and the worktrees to remove."""
    from dflash_jax.assets.default_model import default_target_path

    trees, srv = [], {}
    for name, rev, extra in spec:
        root = ROOT
        if rev:
            root = Path(tempfile.mkdtemp(prefix="dflash-base-")) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(root), rev], cwd=ROOT, check=True, capture_output=True)
            trees.append(root)
        port = free_port()
        argv = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r}); from dflash_jax.cli.main import entry; entry()",
                "serve", "--port", str(port), *extra]
        srv[name] = dict(proc=start(name, argv, port, logs / f"{name.split()[0]}.log"), url=f"http://127.0.0.1:{port}",
                         model=Path(default_target_path()).name)
        print(f"{name} up on port {port}", flush=True)
    return srv, trees


def report_mixed(results: dict, args) -> list[str]:
    lines = [f"Mixed requests: every other request greedy, the others temperature 0.7, top-p 0.9 with a seed each, all sent at once "
             f"against one by one; {args.max_tokens} new tokens at most per request; median of {args.reps} alternating pairs of "
             "schedules.", "",
             "| server | requests | at once (tok/s) | one by one (tok/s) | at once / one by one | same answers |", "|---|---|---|---|---|---|"]
    for n, per in results.items():
        for name, r in per.items():
            lines.append(f"| {name} | {n} | {r['together_tok_s']:.1f} | {r['alone_tok_s']:.1f} | {r['ratio']:.2f}x | {r['same_answers']} |")
    return lines


def report_prefix(results: dict, args) -> list[str]:
    lines = [f"A two-turn chat with a system prompt of about 1.5k tokens (`--max-len 2048`, greedy, {args.max_tokens} new tokens at "
             f"most per turn), a new system prompt each repetition; median of {args.reps} repetitions, the servers alternating. Same "
             f"answers with and without the cache: {results.pop('same_answers')}.", "",
             "| server | turn | prompt tokens | cached | time to first token (s) | tau | turn 2 / turn 1 TTFT |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for i, t in enumerate(r["turns"]):
            ratio = f"{r['second_to_first']:.2f}x" if i == 1 else ""
            lines.append(f"| {name} | {i + 1} | {t['prompt_tokens']} | {t['cached']} | {t['ttft']:.2f} | {t['tau']:.2f} | {ratio} |")
    return lines


def report_rows(results: dict, args, budget_mb: float) -> list[str]:
    same = results.pop("same_answers")
    lines = [f"Many short rows against few long ones at one memory budget: `--max-len 2048 --max-batch 64 --kv-cache-mb {budget_mb:.0f}` "
             f"(what {args.rows_budget} unpaged rows of 2048 tokens hold), greedy; {args.short} short chat requests ({args.max_tokens} new "
             f"tokens at most) sent at once, then 4 requests of a 1.5k-token prompt; median of {args.reps} repetitions, the servers "
             f"alternating. Same answers in both layouts: short {same['short']}, long {same['long']}.", "",
             "| layout | schedule | requests | most rows at once | wall (s) | tok/s |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        for kind in ("short", "long"):
            x = r[kind]
            lines.append(f"| {name} | {kind} | {x['requests']} | {x['peak']} | {x['wall']:.1f} | {x['tok_s']:.1f} |")
    return lines


def _budget_mb(rows_budget: int) -> float:
    """MiB of ``rows_budget`` unpaged rows of 2048 tokens of the default pair (its ``n_max="auto"`` set-up)."""
    from dflash_jax.decode.state import Decoding
    from dflash_jax.loading import load_target, shipped_drafter
    from dflash_jax.serve.pages import row_bytes

    target = load_target()
    return rows_budget * row_bytes(Decoding(target.cfg, shipped_drafter(target).cfg, n_max=4), 2048) / 2**20


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="mixed,prefix,rows", help="comma-separated: mixed, prefix, rows (default all)")
    p.add_argument("--short", type=int, default=32, help="rows: short requests sent at once (default 32)")
    p.add_argument("--rows-budget", type=int, default=4, help="rows: the budget in unpaged rows of 2048 tokens (default 4)")
    p.add_argument("--requests", type=int_list, default=[8, 16], help="mixed: requests per schedule (default 8,16)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="alternating pairs of schedules, or repetitions (default 3)")
    p.add_argument("--baseline", metavar="REV", help="mixed: also serve from a git worktree of REV")
    p.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    logs = ROOT / "runs" / "bench_workloads"
    logs.mkdir(parents=True, exist_ok=True)
    m = machine()
    command = "python tools/bench_workloads.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["### Serving workloads: mixed requests and prefix reuse (`tools/bench_workloads.py`)", "",
             f"{datetime.date.today()}, {m['cpu']} ({m['cores']} cores), JAX {m['jax']}; `{command}`; `dflash-jax serve` with its "
             "defaults (the embedded default pair, DFlash) unless said.", ""]
    work = args.workloads.split(",")
    if "mixed" in work:
        spec = [("this tree", None, [])] + ([(f"baseline {args.baseline}", args.baseline, [])] if args.baseline else [])
        srv, trees = servers(spec, logs)
        try:
            lines += report_mixed({n: mixed(srv, n, args.max_tokens, args.reps) for n in args.requests}, args) + [""]
            print("\n".join(lines), flush=True)
        finally:
            stop(srv)
            for tree in trees:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    if "prefix" in work:
        spec = [("prefix cache", None, ["--max-len", "2048"]), ("no cache", None, ["--max-len", "2048", "--prefix-cache-mb", "0"])]
        srv, _ = servers(spec, logs)
        try:
            lines += report_prefix(prefix(srv, args.max_tokens, args.reps), args)
        finally:
            stop(srv)
    if "rows" in work:
        mb = _budget_mb(args.rows_budget)
        common = ["--max-len", "2048", "--max-batch", "64", "--kv-cache-mb", f"{mb:.3f}"]
        srv, _ = servers([("rows", None, common + ["--kv-layout", "rows"]), ("paged", None, common + ["--kv-layout", "paged"])], logs)
        try:
            lines += [""] + report_rows(rows(srv, args.short, args.max_tokens, args.reps), args, mb)
        finally:
            stop(srv)
    publish("\n".join(lines), args, "Serving workloads", "bench_workloads")


if __name__ == "__main__":
    main()
