"""What streaming an answer's text costs on the host: ``TextStream`` with the tokenizer's incremental
decoder (each id decoded once, ``tokenizers.decoders.DecodeStream``) against decoding every id so far
at each step (what it did before, and what it still does for a tokenizer without ``decode_stream``).

The default target's tokenizer, ids of README.md's own text fed one per step (as a plain step commits
them) with one stop text; the texts must come out equal. Best of ``--rounds`` runs of each, alternating.

    python tools/bench_text_stream.py                  # writes its section of BENCHMARKS.md
    python tools/bench_text_stream.py --no-write
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import at_least, int_list, machine, publish  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def stream_ms(tokenizer, ids, stop) -> tuple[float, str]:
    """Milliseconds to stream ``ids`` one per step (and the text streamed)."""
    import dflash_jax as dj

    s = dj.TextStream(tokenizer, stop)
    t0 = time.perf_counter()
    text = "".join(s.feed([i]) for i in ids) + s.finish()
    return (time.perf_counter() - t0) * 1e3, text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int_list, default=[512, 2048, 4096], help="answer lengths in tokens")
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--no-write", action="store_true", help="print the section; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)

    import dflash_jax as dj

    tok = dj.load_target().tokenizer

    class WholeDecode:  # the same tokenizer without its incremental decoder
        decode = staticmethod(tok.decode)

    ids = tok.encode((REPO / "README.md").read_text(encoding="utf-8"))
    rows = []
    for n in args.lengths:
        if n > len(ids):
            raise SystemExit(f"--lengths: {n} is more than README.md's {len(ids)} tokens")
        best = {"incremental": float("inf"), "whole": float("inf")}
        texts = {}
        for _ in range(args.rounds):
            for name, t in (("incremental", tok), ("whole", WholeDecode())):
                ms, texts[name] = stream_ms(t, ids[:n], ["STOP"])
                best[name] = min(best[name], ms)
        assert texts["incremental"] == texts["whole"], f"the texts differ at {n} tokens"
        rows.append(f"| {n} | {best['incremental']:.1f} | {best['whole']:.1f} | {best['whole'] / best['incremental']:.0f}x |")
    m = machine()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    table = "\n".join(rows)
    cmd = shlex.join(["python", "tools/bench_text_stream.py", *(sys.argv[1:] if argv is None else argv)])
    text = f"""## Streaming an answer's text (`tools/bench_text_stream.py`)

`{cmd}` ({when}); the default target's tokenizer, README.md's
ids fed to `TextStream` one per step with one stop text, best of {args.rounds} alternating runs; both give the same text.

| answer tokens | incremental decoder ms (whole answer) | decoding everything at each step ms | ratio |
|---|---|---|---|
{table}

The server streams every answer through `TextStream` on its engine thread, between decode rounds: decoding
everything at each step grew with the square of the answer's length (about 1 s of host time for a 4096-token
answer here), the incremental decoder with its length.

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; Python {m['python']}.
"""
    publish(text, args, "text_stream", "bench_text_stream")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
