"""The prompts of the self-distillation recipe (``dflash-jax make-data``), built offline and
deterministically (``docs/specs/dflash.md`` 3.1):

* code prompts from the Python standard library: public functions and methods with a docstring
  in :data:`TRAIN_MODULES`, asked in the templates of :data:`CODE_TEMPLATES` (complete the function
  from its signature and docstring in a code block, as the HumanEval benchmark asks; write it from
  a description; explain it with an example; write tests); round 1 asks each function once, round
  2 (appended after everything else, so older prompt lists stay a prefix) asks it again in another
  template, ``complete`` where round 1 used another;
* general instructions: fixed templates x fixed topics;
* shuffled with ``random.Random(seed)``; prompts equal to a held-out evaluation prompt (ours, and
  :mod:`dflash_jax.assets.prompts`' chat and code sets) are dropped. HumanEval is never read;
* or (:func:`source_prompts`) the ``complete`` template over every documented function of named
  sources, read with ``ast`` (:mod:`dflash_jax.train.source_code`).
"""

from __future__ import annotations

import inspect
import random
import re
import textwrap

from dflash_jax.assets.prompts import CHAT_PROMPTS, CODE_PROMPTS, HUMANEVAL_TEMPLATE  # the benchmark's prompts: held out
from dflash_jax.train.source_code import EVAL_MODULES, source_functions

# Modules whose import has no side effects; sorted names make the list order deterministic.
TRAIN_MODULES = sorted([
    "abc", "argparse", "array", "ast", "base64", "binascii", "bisect", "bz2", "calendar", "cmath", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.utils",
    "enum", "filecmp", "fnmatch", "fractions", "functools", "getopt", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac",
    "html", "html.parser", "http.cookies", "io", "ipaddress", "itertools",
    "json", "keyword", "linecache", "locale", "logging", "lzma", "math", "mimetypes", "numbers", "operator",
    "pathlib", "pickletools", "pprint", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil",
    "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "tomllib",
    "traceback", "types", "typing", "unicodedata", "urllib.parse", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom",
    "zipfile", "zlib",
])

# The benchmark's HumanEval question, asked here about other functions.
COMPLETE = HUMANEVAL_TEMPLATE.replace("{prompt}", "{stub}")
CODE_TEMPLATES = [
    ("complete", COMPLETE),
    ("complete", COMPLETE),
    ("describe", "Write a Python function `{name}{sig}` that does the following: {summary}"),
    ("scratch", "Implement `{name}{sig}` in Python from scratch, without importing `{module}`. {summary}"),
    ("explain", "Explain what `{qual}` does in Python and show a short example of how to use it."),
    ("tests", "Write a few pytest unit tests for the Python standard library function `{qual}{sig}`."),
]

GENERAL_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me three practical tips about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Describe {t} to a high-school student.",
    "List five interesting facts about {t}.",
    "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?",
    "How would you teach {t} to a beginner? Give a step-by-step plan.",
    "Write a friendly email to a colleague about {t}.",
]
GENERAL_TOPICS = [
    "the water cycle", "black holes", "machine learning", "time management", "the French Revolution", "volcanoes",
    "recycling", "learning a new language", "the internet", "electric cars", "coffee", "public speaking", "climate change",
    "the human heart", "budgeting money", "gardening", "the Roman Empire", "earthquakes", "vaccines", "solar energy",
    "chess", "meditation", "the stock market", "renewable energy", "honeybees", "cloud computing", "the printing press",
    "rainforests", "job interviews", "version control with git", "databases", "the moon landing", "healthy eating",
    "running a marathon", "the immune system", "artificial intelligence", "the Great Wall of China", "volunteering",
    "writing a resume", "the periodic table", "friendship", "bread baking", "traveling on a budget", "ocean tides",
    "electricity", "the theory of evolution", "smartphones", "urban planning", "open-source software", "team work",
    "dinosaurs", "the Olympic Games", "music theory", "cybersecurity", "remote work", "antibiotics", "glaciers",
    "composting", "the stock exchange", "3D printing", "the Renaissance", "sleep hygiene for students", "wind turbines",
    "linear algebra", "probability", "unit testing", "sorting algorithms", "regular expressions", "binary numbers",
    "object-oriented programming", "the SQL language", "operating systems", "compilers", "computer networks",
]
CODING_TASKS = [
    "counts the vowels in a string", "merges two sorted lists into one sorted list", "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome, ignoring case and spaces", "flattens a nested list", "computes the factorial of n",
    "removes duplicates from a list while keeping the order", "returns the most common word in a text",
    "converts a temperature from Celsius to Fahrenheit", "finds the second largest number in a list",
    "groups a list of words by their first letter", "checks whether two strings are anagrams", "computes the GCD of two numbers",
    "reads a CSV file and returns the rows as dictionaries", "validates an email address with a regular expression",
    "rotates a list by k positions", "computes the running average of a list of numbers", "transposes a matrix",
    "counts the lines, words and characters in a file", "implements binary search on a sorted list",
    "converts a Roman numeral to an integer", "splits a list into chunks of size n", "returns all prime numbers below n",
    "capitalizes the first letter of every word", "computes the dot product of two vectors", "parses a date string",
    "sums the digits of an integer", "finds the longest common prefix of a list of strings", "implements a stack class",
    "implements a queue using two stacks", "counts the frequency of each character", "checks if a year is a leap year",
    "converts a decimal number to binary", "finds all pairs in a list that sum to a target", "reverses the words in a sentence",
    "computes the median of a list", "normalizes a list of numbers to the range 0 to 1", "deep-copies a nested dictionary",
    "computes the Levenshtein distance between two strings", "implements bubble sort",
]
CODING_TEMPLATES = [
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a docstring and an example.",
    "How can I write a Python function that {task}?",
]

EVAL_CHAT = [  # held out: none of these, nor their topics, are in the training prompts
    "What are some good ways to stay focused while studying?",
    "Write a short thank-you note to a teacher.",
    "Explain how a refrigerator keeps food cold.",
    "What is the difference between weather and climate?",
]


def _summary(doc: str, limit: int = 300) -> str:
    first = doc.strip().split("\n\n")[0]
    first = " ".join(first.split())
    return first if len(first) <= limit else first[:limit].rsplit(" ", 1)[0] + " ..."


def _functions(modname: str):
    """``(module, qualname, name, signature, docstring)`` of public documented functions and
    methods defined in ``modname``, in sorted order."""
    import importlib

    try:
        mod = importlib.import_module(modname)
    except Exception:
        return []
    out = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_"):
            continue
        owner = getattr(obj, "__module__", None)
        if owner is None or not (owner == mod.__name__ or owner.lstrip("_") == mod.__name__):
            continue
        items = []
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            items.append((f"{modname}.{name}", name, obj))
        elif inspect.isclass(obj):
            for mname, m in sorted(vars(obj).items()):
                if not mname.startswith("_") and (inspect.isfunction(m) or inspect.ismethoddescriptor(m)):
                    items.append((f"{modname}.{name}.{mname}", mname, m))
        for qual, fname, f in items:
            doc = inspect.getdoc(f)
            if not doc or len(doc) < 20:
                continue
            try:
                sig = str(inspect.signature(f))
            except (TypeError, ValueError):
                continue
            sig = re.sub(r" at 0x[0-9a-fA-F]+", "", sig)  # default values' reprs hold memory addresses
            if len(sig) > 120:
                continue
            out.append((modname, qual, fname, sig, doc))
    return out


def _stub(name: str, sig: str, doc: str) -> str:
    body = textwrap.indent(_summary(doc, 400).replace('"""', "'''"), "    ")
    return f'def {name}{sig}:\n    """\n{body}\n    """\n'


def code_prompts(modules, rng: random.Random, rng2: random.Random) -> tuple[list[dict], list[dict]]:
    """Two rounds of prompts over the documented functions of ``modules``: round 1 asks each
    function in one template drawn from :data:`CODE_TEMPLATES` with ``rng``; round 2 asks it
    again, as the HumanEval benchmark does (``complete``) when round 1 did not, otherwise in
    another template drawn with ``rng2`` (a generator of its own, so round 1 does not change)."""
    first, second = [], []
    for modname in modules:
        for module, qual, name, sig, doc in _functions(modname):
            fields = dict(stub=_stub(name, sig, doc), name=name, sig=sig, summary=_summary(doc), module=module, qual=qual)
            kind, tmpl = CODE_TEMPLATES[rng.randrange(len(CODE_TEMPLATES))]
            first.append({"source": f"stdlib:{qual}", "kind": kind, "text": tmpl.format(**fields)})
            others = [t for t in CODE_TEMPLATES if t[0] != kind]
            kind2, tmpl2 = CODE_TEMPLATES[0] if kind != "complete" else others[rng2.randrange(len(others))]
            second.append({"source": f"stdlib:{qual}", "kind": kind2, "text": tmpl2.format(**fields)})
    return first, second


def general_prompts() -> list[dict]:
    """The general instructions (:data:`GENERAL_TEMPLATES` x :data:`GENERAL_TOPICS`) and the coding tasks
    (:data:`CODING_TEMPLATES` x :data:`CODING_TASKS`), as ``{"source", "kind", "text"}`` records, in order."""
    out = [{"source": "general", "kind": "general", "text": t.format(t=topic)} for topic in GENERAL_TOPICS for t in GENERAL_TEMPLATES]
    out += [{"source": "coding", "kind": "coding", "text": t.format(task=task)} for task in CODING_TASKS for t in CODING_TEMPLATES]
    return out


def held_out_prompts() -> list[str]:
    """Evaluation prompts never trained on: :data:`EVAL_CHAT` plus four held-out stdlib functions
    asked like the HumanEval benchmark."""
    rng = random.Random(1234)
    funcs = [f for m in EVAL_MODULES for f in _functions(m)]
    rng.shuffle(funcs)
    code = [COMPLETE.format(stub=_stub(name, sig, doc)) for _, _, name, sig, doc in funcs[:4]]
    return EVAL_CHAT + code


def build_prompts(seed: int, code_fraction: float) -> list[dict]:
    """The full deterministic prompt list (shuffled), held-out prompts removed."""
    rng = random.Random(seed)
    code, code2 = code_prompts(TRAIN_MODULES, rng, random.Random(seed + 1))
    general = general_prompts()
    rng.shuffle(code)
    rng.shuffle(general)
    rng.shuffle(code2)
    # interleave to the requested code fraction, so any prefix of the list has the same mix
    out, ci, gi = [], 0, 0
    while ci < len(code) or gi < len(general):
        take_code = gi >= len(general) or (ci < len(code) and ci < code_fraction * (ci + gi + 1))
        if take_code:
            out.append(code[ci])
            ci += 1
        else:
            out.append(general[gi])
            gi += 1
    out += code2  # appended, so the round-1 list stays a prefix of the whole list
    banned = {p.strip().lower() for p in held_out_prompts() + CHAT_PROMPTS + CODE_PROMPTS}
    return [p for p in out if p["text"].strip().lower() not in banned]


def source_prompts(sources: str, seed: int) -> tuple[dict, list[dict]]:
    """``(roots, prompts)``: the :data:`COMPLETE` prompt (as HumanEval asks) over every documented
    function of ``sources`` (``--sources``: stdlib and/or installed
    packages, read with ``ast``, never imported; the held-out modules' files are never read),
    shuffled with ``random.Random(seed)``, and the sources' folders (``source_functions``)."""
    roots, items = source_functions(sources, seed)
    return roots, [{"source": it["source"], "kind": "complete", "text": COMPLETE.format(stub=it["stub"])} for it in items]
