"""Load generator for ``dflash-jax serve``: DFlash, ``--no-spec`` and llama.cpp's server side by side.

Starts the three servers on loopback (``dflash-jax serve`` with the embedded default pair,
``dflash-jax serve --no-spec``, and ``python -m llama_cpp.server`` on the same GGUF file when
``llama-cpp-python`` is installed), then at each concurrency (1, 4, 16) sends the same streamed
chat requests (greedy, ``--max-tokens`` new tokens) to each server in turn, alternating the order,
and reports output tokens/s (all requests' tokens over the wall time), time to first token and
inter-token latency (per request: (last token time - first token time) / (tokens - 1)), p50 and
p99. Each server answers one warm-up round per concurrency first (compiles). It also times
``dflash_jax.generate`` (the same prompts, one at a time, DFlash) for the concurrency-1 goal.
Bounded: a few prompts per concurrency, ``--max-tokens`` each; nothing but loopback is contacted.

    python tools/bench_serve.py                 # writes BENCHMARKS.md and tools/results/serve_bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from benchlib import machine, write_section  # noqa: E402
from prompts import CHAT_PROMPTS  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, argv: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited early, see {log}")
        for path in ("/health", "/v1/models"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                pass
        time.sleep(1)
    raise SystemExit(f"{name} did not come up, see {log}")


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, tokens = [], 0
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices and (ch.choices[0].delta.content or ""):
            times.append(time.perf_counter())
        if getattr(ch, "usage", None) is not None:
            tokens = ch.usage.completion_tokens
    tokens = tokens or len(times)  # a server without usage in the stream: one chunk per token
    ttft = times[0] - t0 if times else float("nan")
    itl = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else float("nan")
    return dict(tokens=tokens, ttft=ttft, itl=itl, end=times[-1] if times else t0)


async def load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=900)
    queue = list(prompts)
    results = []

    async def worker():
        while queue:
            results.append(await one(client, model, queue.pop(0), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft = np.array([r["ttft"] for r in results])
    itl = np.array([r["itl"] for r in results if np.isfinite(r["itl"])])
    return dict(tokens=int(sum(r["tokens"] for r in results)), wall=wall, tok_s=sum(r["tokens"] for r in results) / wall,
                ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                itl_p50=float(np.percentile(itl, 50)) if itl.size else float("nan"),
                itl_p99=float(np.percentile(itl, 99)) if itl.size else float("nan"), requests=len(results))


def generate_speed(prompts: list[str], max_tokens: int) -> float:
    """``dflash_jax.generate``'s decode tokens/s (DFlash, default pair), one prompt at a time, median."""
    import dflash_jax as dj

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    speeds = []
    for p in prompts:
        res = dj.generate(target, [dj.encode_prompt(target, p)], max_new_tokens=max_tokens, drafter=drafter)
        speeds.append(res.stats["decode_tokens_per_s"])
    return float(np.median(speeds))


def servers(args, logs: Path) -> dict:
    from dflash_jax.assets import default_target_path

    gguf = str(default_target_path())
    common = ["--max-batch", "16", "--max-len", "512"]
    spec = [
        ("dflash", [sys.executable, "-m", "dflash_jax", "serve", *common]),
        ("plain", [sys.executable, "-m", "dflash_jax", "serve", "--no-spec", *common]),
    ]
    if not args.no_llamacpp:
        spec.append(("llama.cpp", [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "2048",
                                   "--n_threads", str(os.cpu_count())]))
    out = {}
    for name, argv in spec:
        port = free_port()
        argv = argv + ["--port", str(port)]
        out[name] = dict(proc=start(name, argv, port, logs / f"{name.replace('.', '')}.log"), url=f"http://127.0.0.1:{port}",
                         model=Path(gguf).name if name != "llama.cpp" else gguf)
        print(f"{name} up on port {port}", flush=True)
    return out


def run(args) -> dict:
    logs = ROOT / "runs" / "bench_serve"
    logs.mkdir(parents=True, exist_ok=True)
    srv = servers(args, logs)
    results: dict = {name: {} for name in srv}
    try:
        for i, c in enumerate(args.concurrency):
            prompts = (CHAT_PROMPTS * 4)[: max(args.requests_min, c)]
            names = list(srv) if i % 2 == 0 else list(srv)[::-1]  # alternate the order
            for name in names:
                s = srv[name]
                asyncio.run(load(s["url"], s["model"], prompts[:c], c, args.max_tokens))  # warm-up (compiles)
                results[name][c] = r = asyncio.run(load(s["url"], s["model"], prompts, c, args.max_tokens))
                print(f"c={c:2d} {name:9s} {r['tok_s']:7.1f} tok/s  ttft p50 {r['ttft_p50']:.3f}s p99 {r['ttft_p99']:.3f}s  "
                      f"itl p50 {1000 * r['itl_p50']:.1f}ms p99 {1000 * r['itl_p99']:.1f}ms  ({r['requests']} requests)", flush=True)
    finally:
        for s in srv.values():
            s["proc"].send_signal(signal.SIGTERM)
        for s in srv.values():
            try:
                s["proc"].wait(60)
            except subprocess.TimeoutExpired:
                s["proc"].kill()
    results["generate_decode_tok_s"] = generate_speed(CHAT_PROMPTS[:4], args.max_tokens)
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, by_c in results.items():
        if not isinstance(by_c, dict):
            continue
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


def report(results: dict, args, command: str) -> str:
    m = machine()
    lines = [f"### Serving: `dflash-jax serve` (DFlash and plain) and llama.cpp's server, {datetime.date.today().isoformat()}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; jax {m['jax']}. Command: `{command}`. "
             f"Streamed chat requests, greedy, {args.max_tokens} new tokens at most, the same prompts for every server; "
             "each concurrency's warm-up round (compiles) is not counted. The machine is shared with other jobs: "
             "compare the servers within a row (measured side by side, alternating order), not across days.", "",
             "| concurrency | server | output tok/s | TTFT p50 / p99 (s) | inter-token p50 / p99 (ms) | requests |", "|---|---|---|---|---|---|"]
    for c in args.concurrency:
        for name, by_c in results.items():
            if isinstance(by_c, dict) and c in by_c:
                r = by_c[c]
                lines.append(f"| {c} | {name} | {r['tok_s']:.1f} | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | "
                             f"{1000 * r['itl_p50']:.1f} / {1000 * r['itl_p99']:.1f} | {r['requests']} |")
    gen = results["generate_decode_tok_s"]
    one = results["dflash"][args.concurrency[0]]
    lines += ["", f"`dflash_jax.generate` (DFlash, the same prompts one at a time) decodes at {gen:.1f} tokens/s (median); "
              f"the DFlash server at concurrency 1 at {1 / one['itl_p50']:.1f} tokens/s per request (1 / inter-token p50), "
              f"{100 * (1 / one['itl_p50']) / gen:.0f} % of it.", "", "![serving throughput and latency](tools/results/serve_bench.png)"]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-min", type=int, default=4, help="requests per concurrency at least (default 4; else the concurrency)")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp's server")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    results = run(args)
    (ROOT / "tools" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "tools" / "results" / "serve_bench.json").write_text(json.dumps(results, indent=1, default=str))
    body = report(results, args, "python tools/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(body)
    if not args.no_write:
        plot(results, ROOT / "tools" / "results" / "serve_bench.png")
        write_section(ROOT / "BENCHMARKS.md", "serve", body, tool="bench_serve")


if __name__ == "__main__":
    main()
