"""Plots tau versus training tokens from a drafter's ``training_curve.csv``.

    python tools/plot_training_curve.py dflash_jax/assets/drafters/smollm2-135m-instruct/training_curve.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?", type=Path, default=ROOT / "dflash_jax/assets/drafters/smollm2-135m-instruct/training_curve.csv",
                    help="training_curve.csv of an exported drafter (default: the shipped SmolLM2 drafter's)")
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "docs/results/tau_curve.png", help="PNG to write")
    args = ap.parse_args(argv)
    src, out = args.csv, args.out
    try:
        rows = list(csv.DictReader(src.open(encoding="utf-8")))
    except OSError as e:
        ap.error(f"{src}: cannot read ({e.strerror}); expected a drafter's training_curve.csv")
    missing = {"supervised_seen", "tau"} - set(rows[0] if rows else {})
    if missing:
        ap.error(f"{src}: no rows or no column(s) {sorted(missing)}; expected a drafter's training_curve.csv")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [int(r["supervised_seen"]) / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(x, [float(r["tau"]) for r in rows], marker="o", label="tau (held-out prompts, greedy)")
    runs = [int(r.get("run") or 1) for r in rows]
    for i in range(1, len(rows)):
        if runs[i] != runs[i - 1]:  # a run that continued the drafter (dflash-jax train --init-from), on more data
            ax.axvline(x[i - 1], color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"run {runs[i]}", (x[i - 1], ax.get_ylim()[0]), xytext=(3, 3), textcoords="offset points", fontsize=8)
    ax.set(xlabel="supervised training tokens seen (millions)", ylabel="tau", title=src.parent.name)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
