"""Load generator for ``dflash-jax serve``: DFlash, ``--no-spec``, ``dflash_jax.generate`` and
llama.cpp's own server, side by side in one run.

Starts three servers on loopback with their defaults: ``dflash-jax serve`` (the embedded default
pair, DFlash), ``dflash-jax serve --no-spec`` and, when ``llama-cpp-python`` is installed,
``python -m llama_cpp.server`` on the same GGUF file (all cores, ``--interrupt_requests False``:
its default ends a running stream as soon as another request waits; ``OMP_WAIT_POLICY=PASSIVE``:
on a CPU shared with other jobs, its OpenMP threads spinning at every barrier while the other
thread is descheduled made it decode at seconds per token). ``pip install 'llama-cpp-python[server]'``
builds llama.cpp for the host CPU; where the CPU reports AMX that the machine does not let
processes use (a general protection fault at ``ldtilecfg`` on the first request), build it with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"``. Every request is the same
streamed chat request (greedy, ``--max-tokens`` new tokens at most, ``stream_options.include_usage``).

* Concurrency 1: the prompts one at a time; for each prompt, in an order that alternates from
  prompt to prompt, each server answers it and ``dflash_jax.generate`` (in this process, DFlash
  and plain, the same settings) decodes it, so that every server-to-``generate`` ratio is a ratio
  of neighbours in time. A request's decode speed is ``(tokens - 1) / (last token time - first
  token time)`` on the client, ``generate``'s its ``decode_tokens_per_s`` (the same definition:
  the first token comes from prefill).
* Concurrency 4 and 16: ``max(--requests-min, c)`` requests, ``c`` in flight, each server in turn
  (the order alternates), after unmeasured passes of the same schedule until one compiles nothing
  (``dflash_xla_compilations`` in the server's ``/metrics``; at most ``--warmups``): which batch
  shapes occur depends on timing, and a new one compiles (or reads the persistent compilation
  cache) while every row waits.

Reported per server and concurrency: output tokens/s (all requests' tokens over the wall time),
time to first token and inter-token latency (per request ``(last - first) / (tokens - 1)``), p50
and p99 over requests, the longest pause between two streamed chunks (p99 over requests), the
programs the server compiled during the measured pass, and the 1-minute load average. Last, the
cost of host round trips (:func:`round_trips`). Nothing but loopback is contacted. Bounded: about
15 minutes on a loaded 2-core CPU with a warm compilation cache.

    python tools/bench_serve.py                 # writes BENCHMARKS.md and docs/results/serve_bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from benchlib import RESULTS, free_port, machine, start, stop, write_section  # noqa: E402

from dflash_jax.assets.prompts import CHAT_PROMPTS  # noqa: E402

SPEC = {"dflash": True, "plain": False}  # the dflash-jax servers and generate's mode for each


def servers(args, logs: Path) -> dict:
    """``{name: {proc, url, model}}`` of the servers, started one after the other."""
    from dflash_jax.assets.default_model import default_target_path

    gguf = str(default_target_path())
    spec = [("dflash", [sys.executable, "-m", "dflash_jax", "serve"]),
            ("plain", [sys.executable, "-m", "dflash_jax", "serve", "--no-spec"])]
    if not args.no_llamacpp and importlib.util.find_spec("llama_cpp") is not None:
        cores = str(len(os.sched_getaffinity(0)))
        spec.append(("llama.cpp", [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "2048", "--n_threads", cores,
                                   "--n_threads_batch", cores, "--interrupt_requests", "False"]))
    out = {}
    for name, argv in spec:
        port = free_port()
        out[name] = dict(proc=start(name, argv + ["--port", str(port)], port, logs / f"{name.replace('.', '')}.log"),
                         url=f"http://127.0.0.1:{port}", model=gguf if name == "llama.cpp" else Path(gguf).name)
        print(f"{name} up on port {port}", flush=True)
    return out


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request: tokens, TTFT, inter-token latency, decode speed, pauses."""
    t0 = time.perf_counter()
    times, tokens = [], 0
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices and (ch.choices[0].delta.content or ""):
            times.append(time.perf_counter())
        if getattr(ch, "usage", None) is not None:
            tokens = ch.usage.completion_tokens
    tokens = tokens or len(times)  # llama.cpp's server sends no usage when streaming: one chunk per token
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    return dict(tokens=tokens, ttft=times[0] - t0 if times else float("nan"), itl=span / (tokens - 1) if tokens > 1 else float("nan"),
                decode_tok_s=(tokens - 1) / span if tokens > 1 and span > 0 else float("nan"),
                pause=float(np.max(np.diff(times))) if len(times) > 1 else float("nan"))


async def _load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=900)
    queue, records = list(prompts), []

    async def worker():
        while queue:
            records.append(await one(client, model, queue.pop(0), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return dict(records=records, wall=wall, load=os.getloadavg()[0])


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(s: dict, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Sends ``prompts`` to the server ``s``, ``concurrency`` in flight: ``{records, wall, load,
    cpu}`` (``cpu``: the server's CPU seconds meanwhile, which other jobs on the machine do not
    inflate the way they stretch wall times)."""
    c0 = cpu_seconds(s["proc"].pid)
    out = asyncio.run(_load(s["url"], s["model"], prompts, concurrency, max_tokens))
    return dict(out, cpu=cpu_seconds(s["proc"].pid) - c0)


def compilations(s: dict) -> float | None:
    """The server's ``dflash_xla_compilations`` (``/metrics``), or ``None`` for a server without it."""
    try:
        with urllib.request.urlopen(s["url"] + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith("dflash_xla_compilations ")), None)


def measure(s: dict, prompts: list[str], concurrency: int, max_tokens: int, passes: int) -> dict:
    """Runs the schedule unmeasured until a pass compiles nothing (at most ``passes`` times; a
    new batch shape compiles once and stalls every row meanwhile), then once measured: its
    :func:`summary` with ``compiles``, the programs compiled during the measured pass."""
    for _ in range(passes):
        before = compilations(s)
        load(s, prompts, concurrency, max_tokens)
        if before is None or compilations(s) == before:
            break
    before = compilations(s)
    out = summary([load(s, prompts, concurrency, max_tokens)])
    out["compiles"] = None if before is None else compilations(s) - before
    return out


def summary(runs: list[dict]) -> dict:
    """Throughput and latency percentiles of one or more :func:`load` results (walls added)."""
    recs = [r for run in runs for r in run["records"]]

    def pct(key, q):
        v = np.array([r[key] for r in recs], float)
        v = v[np.isfinite(v)]
        return float(np.percentile(v, q)) if v.size else float("nan")

    tokens = sum(r["tokens"] for r in recs)
    wall = sum(run["wall"] for run in runs)
    loads = [run["load"] for run in runs]
    return dict(tokens=tokens, wall=wall, tok_s=tokens / wall, cpu_ms_per_token=1000 * sum(run["cpu"] for run in runs) / tokens, requests=len(recs), ttft_p50=pct("ttft", 50), ttft_p99=pct("ttft", 99),
                itl_p50=pct("itl", 50), itl_p99=pct("itl", 99), pause_p99=pct("pause", 99), load=[min(loads), max(loads)])


class Generate:
    """``dflash_jax.generate`` of the default pair in this process, DFlash or plain."""

    def __init__(self):
        import dflash_jax as dj

        self.dj = dj
        self.target = dj.load_target()
        self.drafter = dj.shipped_drafter(self.target)

    def __call__(self, prompt: str, spec: bool, max_tokens: int) -> dict:
        """``{decode_tok_s, tokens, prefill_s, cpu}`` of one greedy chat prompt (compile not counted;
        ``cpu``: this process's CPU seconds for the call, prefill and decode, nothing compiled
        after the first call of a shape)."""
        dj = self.dj
        c0 = sum(os.times()[:2])
        res = dj.generate(self.target, [dj.encode_prompt(self.target, prompt)], max_new_tokens=max_tokens,
                          drafter=self.drafter if spec else None)
        return dict(decode_tok_s=res.stats["decode_tokens_per_s"], tokens=res.stats["new_tokens"], prefill_s=res.stats["prefill_time_s"],
                    cpu=sum(os.times()[:2]) - c0)


def round_trips(gen: Generate, prompt: str, max_tokens: int, reps: int) -> dict:
    """CPU seconds per decode step of one greedy answer run as one on-device loop, and in host
    rounds of 1 and of 4 steps (``decode.generate_until`` with a step bound, then the read-back
    the server does), alternating; ``{mode: {variant: ratio to the loop (median of pairs)}}``
    plus the loop's ms per step. CPU time, not wall time: the machine is shared."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import loop as decode
    from dflash_jax.arguments import default_max_len
    from dflash_jax.serve.jobs import ServedModel

    t = gen.target
    ids = gen.dj.encode_prompt(t, prompt)
    out = {}
    for mode, spec in SPEC.items():
        served = ServedModel(t, gen.drafter if spec else None)  # the server's greedy set-up
        static, params = served.decoding(), served.params

        def once(k):
            s = decode.init_state(static, [ids], default_max_len([ids], max_tokens), max_tokens, tuple(t.eos_ids))
            s = jax.block_until_ready(decode.prefill(params, s, static, 64, len(ids)))
            c0 = time.process_time()
            while True:
                s = decode.generate_until(params, s, static, jnp.int32(1), None if k is None else jnp.int32(k))
                if jax.device_get(s.finish)[0] or k is None:
                    break
            return (time.process_time() - c0) / int(s.steps)

        variants, per = (None, 1, 4), {None: [], 1: [], 4: []}
        for k in variants:
            once(k)  # compiles
        for rep in range(reps):
            for k in (variants if rep % 2 == 0 else variants[::-1]):
                per[k].append(once(k))
        base = np.array(per[None])
        out[mode] = dict(loop_ms=1000 * float(np.median(base)), **{f"rounds_of_{k}": float(np.median(np.array(per[k]) / base)) for k in (1, 4)})
    return out


def concurrency_one(srv: dict, gen: Generate, prompts: list[str], max_tokens: int, warm: bool) -> tuple[dict, dict]:
    """Concurrency 1, servers and ``generate`` alternating per prompt (module docstring):
    ``({server: summary}, {mode: per-prompt server and generate figures})``."""
    runs: dict = {name: [] for name in srv}
    pairs: dict = {mode: [] for mode in SPEC}
    jobs = [(name, "server") for name in srv] + [(mode, "generate") for mode in SPEC]
    for i, prompt in enumerate(prompts):
        got = {}
        for name, kind in (jobs if i % 2 == 0 else jobs[::-1]):
            if kind == "server":
                got[name] = load(srv[name], [prompt], 1, max_tokens)
                runs[name].append(got[name])
            else:
                got["generate " + name] = gen(prompt, SPEC[name], max_tokens)
        for mode in SPEC:
            r, g = got[mode]["records"][0], got["generate " + mode]
            pairs[mode].append(dict(server=r["decode_tok_s"], generate=g["decode_tok_s"], ratio=r["decode_tok_s"] / g["decode_tok_s"],
                                    server_tokens=r["tokens"], generate_tokens=g["tokens"], ttft=r["ttft"], prefill_s=g["prefill_s"],
                                    load=got[mode]["load"], cpu_ratio=(got[mode]["cpu"] / r["tokens"]) / (g["cpu"] / g["tokens"])))
        if not warm:
            print(f"c= 1 prompt {i}: " + "  ".join(f"{m} server/generate {p[-1]['server']:.1f}/{p[-1]['generate']:.1f} tok/s"
                                                  for m, p in pairs.items()) + f"  load {os.getloadavg()[0]:.1f}", flush=True)
    return {name: summary(r) for name, r in runs.items()}, pairs


def run(args) -> dict:
    logs = ROOT / "runs" / "bench_serve"
    logs.mkdir(parents=True, exist_ok=True)
    gen = Generate()
    srv = servers(args, logs)
    results: dict = {"servers": {name: {} for name in srv}, "load_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    try:
        if 1 in args.concurrency:
            ones = (CHAT_PROMPTS * 4)[: args.pairs]
            concurrency_one(srv, gen, ones[:2], args.max_tokens, warm=True)  # compiles (or reads the cache)
            before = {name: compilations(s) for name, s in srv.items()}
            by_server, results["pairs"] = concurrency_one(srv, gen, ones, args.max_tokens, warm=False)
            for name, r in by_server.items():
                after = compilations(srv[name])
                results["servers"][name][1] = dict(r, compiles=None if after is None else after - before[name])
        for i, c in enumerate(x for x in args.concurrency if x != 1):
            prompts = (CHAT_PROMPTS * 4)[: max(args.requests_min, c)]
            for name in (list(srv) if i % 2 else list(srv)[::-1]):
                results["servers"][name][c] = r = measure(srv[name], prompts, c, args.max_tokens, args.warmups)
                print(f"c={c:2d} {name:9s} {r['tok_s']:7.1f} tok/s  ttft p50 {r['ttft_p50']:.3f}s  itl p50 {1000 * r['itl_p50']:.1f}ms  "
                      f"({r['requests']} requests, {r['compiles']} compiles, load {r['load'][1]:.1f})", flush=True)
    finally:
        stop(srv)
    if args.round_trips:
        results["round_trips"] = round_trips(gen, CHAT_PROMPTS[0], args.max_tokens, args.round_trips)
    results["minutes"] = (time.perf_counter() - t0) / 60
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, by_c in results["servers"].items():
        cs = sorted(by_c)
        axes[0].plot(cs, [by_c[c]["tok_s"] for c in cs], "o-", label=name)
        axes[1].plot(cs, [by_c[c]["ttft_p50"] for c in cs], "o-", label=name)
        axes[2].plot(cs, [1000 * by_c[c]["itl_p50"] for c in cs], "o-", label=name)
    for ax, title in zip(axes, ("output tokens/s (all requests)", "time to first token p50 (s)", "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(results: dict, concurrency: list[int]) -> list[str]:
    lines = ["| concurrency | server | output tok/s | x its c=1 | CPU ms per token | TTFT p50 / p99 (s) | inter-token p50 / p99 (ms) "
             "| longest pause p99 (ms) | requests | compiles | load avg |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in concurrency:
        for name, by_c in results["servers"].items():
            if c in by_c:
                r, base = by_c[c], by_c.get(1, by_c[c])
                lines.append(f"| {c} | {name} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f} | {r['cpu_ms_per_token']:.0f} | "
                             f"{r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | "
                             f"{1000 * r['itl_p50']:.1f} / {1000 * r['itl_p99']:.1f} | {1000 * r['pause_p99']:.0f} | {r['requests']} | "
                             f"{'-' if r['compiles'] is None else int(r['compiles'])} | "
                             f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    return lines


def _pairs_table(pairs: dict) -> list[str]:
    lines = ["| mode | server decode tok/s (median) | `generate` decode tok/s (median) | server / `generate` (median of pairs, min-max) "
             "| CPU per token, server / `generate` (median) | server TTFT p50 (s) | `generate` prefill p50 (s) | same token counts | load avg |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, ps in pairs.items():
        ratios = [p["ratio"] for p in ps]
        same = sum(p["server_tokens"] == p["generate_tokens"] for p in ps)
        lines.append(f"| {mode} | {np.median([p['server'] for p in ps]):.1f} | {np.median([p['generate'] for p in ps]):.1f} | "
                     f"{np.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) | {np.median([p['cpu_ratio'] for p in ps]):.3f} | "
                     f"{np.median([p['ttft'] for p in ps]):.3f} | "
                     f"{np.median([p['prefill_s'] for p in ps]):.3f} | {same}/{len(ps)} | "
                     f"{min(p['load'] for p in ps):.1f}-{max(p['load'] for p in ps):.1f} |")
    return lines


def _llamacpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f", llama-cpp-python {version('llama-cpp-python')}"
    except PackageNotFoundError:
        return ""


def _reading(results: dict) -> list[str]:
    """What the tables say about the issue's goals, with this run's figures."""
    srv, out = results["servers"], []
    if "pairs" in results:
        p = {m: (np.median([x["ratio"] for x in ps]), np.median([x["cpu_ratio"] for x in ps])) for m, ps in results["pairs"].items()}
        out.append("- Concurrency 1 against `generate`: " + "; ".join(f"{m} server {r:.3f}x its decode speed ({c:.3f}x its CPU per token)"
                                                                     for m, (r, c) in p.items()) +
                   ". The server's round trips (one per `--steps-per-round` steps), text and SSE cost what the CPU ratio says; "
                   "the wall ratio adds the other jobs' noise.")
    for name in ("dflash", "plain"):
        cs = sorted(srv.get(name, {}))
        if len(cs) > 1:
            out.append(f"- Throughput with concurrency, {name}: " + " -> ".join(f"{srv[name][c]['tok_s']:.1f}" for c in cs) +
                       f" tok/s at {', '.join(map(str, cs))} (rows decoded together share each pass over the weights: CPU per token "
                       f"{srv[name][cs[0]]['cpu_ms_per_token']:.0f} -> {srv[name][cs[-1]]['cpu_ms_per_token']:.0f} ms).")
    if "llama.cpp" in srv and 1 in srv["llama.cpp"] and "plain" in srv:
        ll, pl, top = srv["llama.cpp"], srv["plain"], max(srv["llama.cpp"])
        out.append(f"- llama.cpp's server: {ll[1]['tok_s']:.1f} tok/s at concurrency 1 ({ll[1]['tok_s'] / pl[1]['tok_s']:.2f}x plain, "
                   f"{ll[1]['cpu_ms_per_token']:.0f} against {pl[1]['cpu_ms_per_token']:.0f} ms CPU per token): it computes on the "
                   "Q4_1 weights with quantized kernels (about 5 bits a weight, against the float32 copy of the dequantized file that "
                   "dflash-jax runs: about a sixth of the bytes read per token on a memory-bound CPU). But llama-cpp-python's server "
                   "answers one request at a time (one llama context behind a lock, no batching): its throughput stays flat "
                   f"({ll[top]['tok_s']:.1f} tok/s at {top}) and the queue shows in its time to first token "
                   f"({ll[top]['ttft_p50']:.1f} s p50 at {top}); there the plain server gives {pl[top]['tok_s'] / ll[top]['tok_s']:.2f}x "
                   "its throughput.")
    if "dflash" in srv and "plain" in srv and "round_trips" in results:
        rt = results["round_trips"]
        out.append(f"- DFlash against plain: a DFlash step (draft, then verify a block) costs {rt['dflash']['loop_ms']:.0f} ms CPU against "
                   f"{rt['plain']['loop_ms']:.0f} for a plain step, so DFlash gains only where it commits more than "
                   f"{rt['dflash']['loop_ms'] / rt['plain']['loop_ms']:.1f} tokens a step; on these chat prompts the shipped drafter "
                   "does not (chat tau in `tools/bench_spec.py`'s section), at any concurrency.")
    return out


def report(results: dict, args, command: str) -> str:
    m = machine()
    loads = [x for by_c in results["servers"].values() for r in by_c.values() for x in r["load"]]
    lines = [f"### Serving: `dflash-jax serve` (DFlash and plain), `generate` and llama.cpp's server, {datetime.date.today().isoformat()}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; jax {m['jax']}{_llamacpp_version()}. Command: `{command}` "
             f"({results['minutes']:.1f} minutes). Servers with their defaults, the same GGUF file (llama.cpp with all cores and "
             "`--interrupt_requests False` and `OMP_WAIT_POLICY=PASSIVE`, see the tool's docstring); streamed chat requests, greedy, "
             f"{args.max_tokens} new tokens at most, the same prompts for every server. The machine is shared with other jobs: "
             f"1-minute load average {min(loads):.1f}-{max(loads):.1f} during the run on {m['cores']} cores; compare within a "
             "concurrency (measured side by side, alternating order), not across days.", "", *_table(results, args.concurrency)]
    if "pairs" in results:
        lines += ["", "Concurrency 1 against `dflash_jax.generate` (the same prompts, one at a time, each prompt's server request "
                  "and `generate` run next to each other, alternating order); decode tokens/s = (tokens - 1) / decode time for both:", "",
                  *_pairs_table(results["pairs"])]
    if "round_trips" in results:
        lines += ["", "Host round trips (what `--steps-per-round` trades against the time a disconnected client's row is held): "
                  "CPU time per decode step of one answer in rounds of 1 and of 4 steps, each followed by the server's read-back, "
                  "relative to one on-device loop (median of alternating pairs):", "",
                  "| mode | on-device loop (ms CPU per step) | rounds of 1 step | rounds of 4 steps |", "|---|---|---|---|"]
        lines += [f"| {mode} | {r['loop_ms']:.1f} | {r['rounds_of_1']:.3f} | {r['rounds_of_4']:.3f} |" for mode, r in results["round_trips"].items()]
    lines += ["", "Reading:", "", *_reading(results), "", "![serving throughput and latency](docs/results/serve_bench.png)"]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=8, help="prompts at concurrency 1, each sent to every server and to generate (default 8)")
    p.add_argument("--requests-min", type=int, default=4, help="requests per concurrency above 1 at least (default 4; else the concurrency)")
    p.add_argument("--warmups", type=int, default=4, help="unmeasured passes per concurrency above 1 at most, until one compiles "
                   "nothing (default 4)")
    p.add_argument("--round-trips", type=int, default=4, metavar="REPS",
                   help="repetitions of the host round-trip cost measurement (default 4; 0 skips it)")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp's server")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    results = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve_bench.json").write_text(json.dumps(results, indent=1, default=str))
    body = report(results, args, "python tools/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(body)
    if not args.no_write:
        plot(results, RESULTS / "serve_bench.png")
        write_section(ROOT / "BENCHMARKS.md", "serve", body, tool="bench_serve")


if __name__ == "__main__":
    main()
