"""A fresh ``dflash-jax serve`` as a user meets it: start-up on an empty compile cache, then a burst
of concurrent chat requests against the same requests sent one at a time.

The server (the embedded default pair, its defaults and ``--max-batch``, plus ``--server-args``)
starts with ``DFLASH_JAX_CACHE`` set to a new folder that holds only links to the model's files
(the GGUF, its float32 cache and tokenizer: no download or dequantization), so its compile cache
and step costs start empty. Measured: the seconds until ``/health`` answers (the warm-up:
compiling every batch size, and under ``--n-max auto`` measuring its step costs); then
``--requests`` greedy chat requests (non-streamed, ``--max-tokens`` new tokens at most) all at
once, then the same requests one after another. Reported: each phase's output tokens/s, the
ratio burst / one at a time, whether every burst answer equals its answer alone, and the
programs the server compiled during each phase (``dflash_xla_compilations`` of ``/metrics``)::

    python tools/bench_serve_start.py                          # writes a section of BENCHMARKS.md
    python tools/bench_serve_start.py --server-args="--n-max auto" --no-write
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_serve import compilations, free_port, start, stop  # noqa: E402
from benchlib import at_least, machine, publish  # noqa: E402
from prompts import CHAT_PROMPTS  # noqa: E402


def fresh_cache() -> Path:
    """A new cache folder holding links to the default model's cached files only."""
    from dflash_jax.assets.default_model import cache_dir, default_target_path

    folder = Path(tempfile.mkdtemp(prefix="dflash_jax_serve_start_"))
    gguf = Path(default_target_path())
    for f in cache_dir().glob(gguf.name + "*"):
        (folder / f.name).symlink_to(f)
    return folder


def ask(url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.completion_tokens


def phase(srv: dict, prompts: list[str], max_tokens: int, concurrent: bool) -> dict:
    """The answers, output tokens/s and programs compiled of one phase."""
    before, t0 = compilations(srv), time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(prompts)) as pool:
            out = list(pool.map(lambda p: ask(srv["url"], srv["model"], p, max_tokens), prompts))
    else:
        out = [ask(srv["url"], srv["model"], p, max_tokens) for p in prompts]
    wall = time.perf_counter() - t0
    tokens = sum(n for _, n in out)
    return dict(texts=[t for t, _ in out], tokens=tokens, wall=wall, rate=tokens / wall, compiled=compilations(srv) - before)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-batch", type=at_least(1), default=8, help="the server's --max-batch (default 8)")
    p.add_argument("--requests", type=at_least(2), default=8, help="requests of the burst (default 8: chat prompts)")
    p.add_argument("--max-tokens", type=at_least(1), default=64)
    p.add_argument("--server-args", default="", help="more options of dflash-jax serve, such as \"--n-max auto\"")
    p.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    from dflash_jax.assets.default_model import default_target_path

    cache, port = fresh_cache(), free_port()
    argv_srv = [sys.executable, "-m", "dflash_jax", "serve", "--max-batch", str(args.max_batch), *shlex.split(args.server_args),
                "--port", str(port)]
    prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(args.requests)]
    os.environ["DFLASH_JAX_CACHE"] = str(cache)
    t0 = time.perf_counter()
    proc = start("dflash-jax serve", argv_srv, port, cache / "server.log")
    ready = time.perf_counter() - t0
    srv = {"s": dict(proc=proc, url=f"http://127.0.0.1:{port}", model=Path(default_target_path()).name)}
    try:
        burst = phase(srv["s"], prompts, args.max_tokens, concurrent=True)
        alone = phase(srv["s"], prompts, args.max_tokens, concurrent=False)
    finally:
        stop(srv)
    same = sum(a == b for a, b in zip(burst["texts"], alone["texts"]))
    warm_up = [line.strip() for line in (cache / "server.log").read_text().splitlines() if "is ready in" in line or "measured the step costs" in line]
    m = machine()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = shlex.join(["python", "tools/bench_serve_start.py", *(sys.argv[1:] if argv is None else argv)])
    text = f"""## A fresh server: start-up and a first burst (`tools/bench_serve_start.py`)

`{cmd}` ({when}); `dflash-jax serve --max-batch {args.max_batch} {args.server_args}` on an empty compile cache (the
model's files linked in), then {args.requests} greedy chat requests of at most {args.max_tokens} new tokens all at once, then the
same requests one after another.

| phase | seconds | output tokens/s | programs compiled meanwhile |
|---|---|---|---|
| start until `/health` answers | {ready:.1f} | | |
| {args.requests} requests at once | {burst['wall']:.1f} | {burst['rate']:.1f} | {burst['compiled']:.0f} |
| the same, one at a time | {alone['wall']:.1f} | {alone['rate']:.1f} | {alone['compiled']:.0f} |

Burst against one at a time: **{burst['rate'] / alone['rate']:.2f}x** the throughput; answers equal to their answer alone:
{same} / {args.requests}. The server's warm-up: {'; '.join(f'`{w}`' for w in warm_up) or 'no lines'}.

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    publish(text, args, "serve_start" + ("_" + "_".join(shlex.split(args.server_args)).replace("-", "") if args.server_args else ""),
            "bench_serve_start")
    return 0 if same == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
