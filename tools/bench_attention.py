"""Key-block size of the live-length attention (``dflash_jax.nn.attention.KEY_BLOCK``), side by side.

Two measurements, each alternating the block sizes in one process (medians):

- ``kernel``: the attention alone, every layer of the default target over its KV cache (random
  keys and values of the target's shapes, one query block per layer, each layer's output the next
  one's queries), per live length and query width ``T`` (1: a plain step; 2-8: verify passes);
- ``decode``: whole greedy generations of the default target and its shipped drafter (plain decoding
  and DFlash at a fixed ``n_max``), compiled once per block size, at the API's default capacity; the
  outputs must equal those of the first block size.

Results go to a section of ``BENCHMARKS.md``::

    python tools/bench_attention.py                       # blocks 64,128,256
    python tools/bench_attention.py --blocks 128,256 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import functools
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import at_least, int_list, machine, publish  # noqa: E402
from prompts import CHAT_PROMPTS, humaneval_chat_prompts  # noqa: E402


def kernel_fn(cfg, capacity: int, key_block: int):
    """Jitted ``(q [B, T, Hq, D], k_all, v_all, positions [B, T]) -> [B, T, Hq, D]``: every layer's
    :func:`~dflash_jax.nn.attention.cache_attention`, the output of one the queries of the next."""
    import jax

    from dflash_jax.nn.attention import causal_visible
    from dflash_jax.nn.attention import cache_attention, live_keys

    def run(q, k_all, v_all, positions):
        visible = functools.partial(causal_visible, positions)
        for layer in range(cfg.num_hidden_layers):
            q = cache_attention(q, k_all, v_all, layer, live_keys(positions, capacity), visible, key_block=key_block)
        return q

    return jax.jit(run)


def timed(fn, *args) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def kernel(cfg, blocks, lengths, widths, batch: int, repeats: int) -> list[dict]:
    """Milliseconds of every layer's attention per (live length, width, block), medians of
    ``repeats`` alternating rounds."""
    import jax.numpy as jnp

    from dflash_jax.arguments import default_max_len

    rng = np.random.default_rng(0)
    out = []
    for length in lengths:
        capacity = default_max_len([[0] * length], max(widths))
        shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
        k_all, v_all = (jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for _ in range(2))
        for t in widths:
            q = jnp.asarray(rng.standard_normal((batch, t, cfg.num_attention_heads, cfg.head_dim), dtype=np.float32))
            pos = jnp.broadcast_to(length - 1 + jnp.arange(t, dtype=jnp.int32), (batch, t))
            fns = {blk: kernel_fn(cfg, capacity, blk) for blk in blocks}
            ref = {blk: f(q, k_all, v_all, pos) for blk, f in fns.items()}  # compiles
            first = ref[blocks[0]]
            agree = all(bool(jnp.allclose(r, first, atol=1e-4, rtol=1e-4)) for r in ref.values())
            times = {blk: [] for blk in blocks}
            for r in range(repeats):
                for blk in (blocks if r % 2 == 0 else blocks[::-1]):
                    times[blk].append(timed(fns[blk], q, k_all, v_all, pos))
            ms = {blk: 1000 * statistics.median(v) for blk, v in times.items()}
            out.append(dict(length=length, width=t, capacity=capacity, ms=ms, agree=agree))
            print(f"live {length} T {t}: " + " ".join(f"{b}={v:.2f}" for b, v in ms.items()), file=sys.stderr, flush=True)
    return out


def decode_runs(target, blocks, batch: int, n_max: int, max_new: int, runs: int) -> list[dict]:
    """Decode tokens/s of plain decoding and DFlash (``n_max``) per block size and prompt set,
    medians of ``runs`` alternating runs of one batch (the first ``batch`` prompts of the set)."""
    import jax
    import jax.numpy as jnp

    import dflash_jax as dj
    from bench_spec import fresh_state, setup, state_for
    from dflash_jax.decode import loop as decode
    from dflash_jax.arguments import default_max_len
    from dflash_jax.nn import attention as live_attention

    drafter = dj.shipped_drafter(target)
    args = argparse.Namespace(max_new_tokens=max_new)
    default_block = live_attention.KEY_BLOCK
    out = []
    for name, texts in (("chat", CHAT_PROMPTS), ("HumanEval", humaneval_chat_prompts())):
        prompts = [dj.encode_prompt(target, t) for t in texts[:batch]]
        capacity = default_max_len(prompts, max_new)
        rows = jnp.int32(len(prompts))
        loops, states = {}, {}
        for blk in blocks:
            live_attention.KEY_BLOCK = blk  # read when a function is traced: drop the traces of the last size
            jax.clear_caches()
            try:
                for kind in ("plain", n_max):
                    static, params = setup(target, drafter, kind)
                    st = fresh_state(target, static, params, prompts, args, capacity)
                    states.setdefault("plain" if kind == "plain" else "dflash", st)
                    loops[(kind, blk)] = (static, params, decode.generate_until.lower(params, st, static, rows).compile())
            finally:
                live_attention.KEY_BLOCK = default_block
        rates, ids = {k: [] for k in loops}, {}
        for r in range(runs + 1):  # the first round is untimed
            for key in (list(loops) if r % 2 == 0 else list(loops)[::-1]):
                static, params, loop = loops[key]
                st = state_for(states, static)
                before = int(jax.device_get(st.length).sum())
                t0 = time.perf_counter()
                st = jax.block_until_ready(loop(params, st, rows))
                seconds = time.perf_counter() - t0
                if r:
                    rates[key].append((int(jax.device_get(st.length).sum()) - before) / seconds)
                ids[key] = jax.device_get(st.tokens).tolist()
        for kind in ("plain", n_max):
            med = {blk: statistics.median(rates[(kind, blk)]) for blk in blocks}
            same = all(ids[(kind, blk)] == ids[(kind, blocks[0])] for blk in blocks)
            out.append(dict(set=name, kind=kind, rates=med, same=same))
            print(f"{name} {kind}: " + " ".join(f"{b}={v:.1f}" for b, v in med.items()), file=sys.stderr, flush=True)
    return out


def section(kern, dec, blocks, args, argv) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = machine()
    cmd = shlex.join(["python", "tools/bench_attention.py", *argv])
    base = blocks[-1]
    cols = " | ".join(f"{b} slots" for b in blocks) + " | " + " | ".join(f"{b} / {base}" for b in blocks[:-1])
    rule = "|---" * (2 * len(blocks) - 1)
    krows = "\n".join(f"| {k['length']} | {k['width']} | {k['capacity']} | " + " | ".join(f"{k['ms'][b]:.2f} ms" for b in blocks) + " | "
                      + " | ".join(f"**{k['ms'][b] / k['ms'][base]:.2f}**" for b in blocks[:-1]) + f" | {'yes' if k['agree'] else 'NO'} |" for k in kern)
    drows = "\n".join(f"| {d['set']} | {'plain' if d['kind'] == 'plain' else 'n_max ' + str(d['kind'])} | " + " | ".join(f"{d['rates'][b]:.1f}" for b in blocks)
                      + " | " + " | ".join(f"**{d['rates'][b] / d['rates'][base]:.2f}x**" for b in blocks[:-1]) + f" | {'yes' if d['same'] else 'NO'} |" for d in dec)
    decode_part = "" if not dec else f"""Whole greedy generations (the first {args.decode_batch} prompt(s) of each set as one batch, {args.max_new_tokens} new tokens, the API's
default capacity, {args.runs} timed runs each after an untimed round), decode tokens/s:

| prompts | decoding | {cols} | outputs equal |
|---|---{rule}|---|
{drows}

"""
    return f"""## Key blocks of the live-length attention (`tools/bench_attention.py`)

`{cmd}` ({when}); the default target's shapes (SmolLM2-135M-Instruct: {args.layers} layers, 3 KV heads of 64, 9 query
heads), float32, block sizes alternating in one process, medians. Ratios below 1: the smaller block is faster.

Attention alone (every layer, batch {args.batch}, {args.repeats} rounds; capacity: the API's default for the length):

| live length | T | capacity | {cols} | outputs agree |
|---|---|---{rule}|---|
{krows}

{decode_part}Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int_list, default=[64, 128, 256], help="key-block sizes, the last the baseline")
    p.add_argument("--lengths", type=int_list, default=[20, 150, 300, 600, 1000, 3000], help="live lengths (tokens)")
    p.add_argument("--widths", type=int_list, default=[1, 2, 4, 8], help="query widths T")
    p.add_argument("--batch", type=at_least(1), default=1, help="rows of the attention-alone measurement")
    p.add_argument("--repeats", type=at_least(1), default=15, help="alternating rounds of the attention alone")
    p.add_argument("--decode-batch", type=at_least(0), default=1, help="prompts decoded together (0: skip whole generations)")
    p.add_argument("--n-max", type=at_least(1), default=3, help="DFlash's fixed depth in the whole generations")
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--runs", type=at_least(1), default=4, help="timed runs of each whole generation, alternating")
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if len(args.blocks) < 2:
        p.error(f"argument --blocks: expected at least two sizes (the last is the baseline), got {args.blocks}")

    import dflash_jax as dj

    target = dj.load_target()
    cfg = target.cfg
    block_size = dj.shipped_drafter(target).cfg.block_size
    if args.decode_batch and not args.n_max < block_size:
        p.error(f"argument --n-max: expected at most {block_size - 1} (the shipped drafter's block_size - 1), got {args.n_max}")
    args.layers = cfg.num_hidden_layers
    kern = kernel(cfg, args.blocks, args.lengths, args.widths, args.batch, args.repeats)
    dec = decode_runs(target, args.blocks, args.decode_batch, args.n_max, args.max_new_tokens, args.runs) if args.decode_batch else []
    text = section(kern, dec, args.blocks, args, argv)
    publish(text, args, "key_blocks", "bench_attention")
    return 0


if __name__ == "__main__":
    sys.exit(main())
