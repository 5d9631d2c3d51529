"""Self-distillation data for a DFlash drafter: offline prompts, responses written by the target.

Recipe (deterministic; recorded in ``<out>/meta.json``; ``docs/specs/dflash.md`` 3.1):

* prompts, all built offline on this machine:
  - code prompts from the Python standard library: public functions and methods with a
    docstring in a fixed list of modules, asked in several fixed templates (complete the
    function from its signature and docstring in a code block, as the HumanEval benchmark asks;
    write it from a description; explain it with an example; write tests); round 1 asks each
    function once, round 2 (appended after everything else, so older prompt lists stay a prefix)
    asks it again in another template, ``complete`` where round 1 used another;
  - general instructions: fixed templates x fixed topics;
  - shuffled with ``random.Random(seed)``; prompts equal to a held-out evaluation prompt (ours,
    and ``tools/prompts.py``'s chat set) are dropped. HumanEval is never read;
  - or, with ``--sources``, the ``complete`` template (as HumanEval asks) over every documented
    function of the named standard library and installed packages, read from their source
    as ``tools/make_code_data.py`` reads it (``ast``, never imported; held-out modules left out),
    shuffled with ``random.Random(seed)``;
  - with ``--base DATASET``, the base dataset's sequences come first and the prompts it already
    asks are skipped, so one feature cache serves both and its rows are reused;
* responses: the target's own greedy continuation (SmolLM2-135M-Instruct by default) of each
  prompt rendered with its chat template (default system prompt), by continuous batching with
  ``dflash_jax.decode.loop`` (``--batch-size`` rows of ``--prompt-cap + --max-new`` slots; finished
  rows take the next prompts ``--refill`` at a time), stopping at the tokenizer's
  end-of-generation ids (the stop token is kept);
* stored as token ids (prompt + response) with ``loss_mask`` 1 on the response
  (:class:`dflash_jax.train.data.TokenDataset`), each distinct prompt once (a few prompts
  coincide: one method inherited by several classes), plus ``prompts.jsonl`` (line i: the prompt
  of sequence i) and ``eval_prompts.json`` (held-out, never trained on).

Generation is resumable: answers are saved under ``<out>/shards/`` (``answers_*.npz``, about
``--batch-size`` at a time, each with its prompt's index) and not asked again on a rerun;
``--time-limit`` stops starting new prompts (the running ones finish), and the dataset is the
longest prefix of the prompt list answered::

    python tools/make_train_data.py --out data/smollm2 --num-prompts 1024 --time-limit 1800
    python tools/make_train_data.py --out data/more --base data/smollm2 --sources stdlib,numpy --num-prompts 512
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
import sys
import textwrap
import time
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from prompts import CHAT_PROMPTS, CODE_PROMPTS, HUMANEVAL_TEMPLATE  # noqa: E402  (the benchmark's prompts: held out)

sys.path.pop(0)

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
# Held out of training (``os.path`` is ``posixpath`` here, so it is not in the list above): their
# functions make the code half of the evaluation prompts.
EVAL_MODULES = ["posixpath"]

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


def _code_data():
    """``tools/make_code_data.py`` (imported when needed: it imports this module's templates)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_code_data
    finally:
        sys.path.pop(0)
    return make_code_data


def source_prompts(sources: str, seed: int) -> tuple[dict, list[dict]]:
    """``(roots, prompts)``: the :data:`COMPLETE` prompt (as HumanEval asks) over every documented
    function of ``sources`` (``tools/make_code_data.py``'s ``--sources``: stdlib and/or installed
    packages, read with ``ast``, never imported; the held-out modules' files are never read),
    shuffled with ``random.Random(seed)``, and the sources' folders (``source_functions``)."""
    roots, items = _code_data().source_functions(sources, seed)
    return roots, [{"source": it["source"], "kind": "complete", "text": COMPLETE.format(stub=it["stub"])} for it in items]


class Base:
    """A ``--base`` dataset whose sequences come first in a new one (``path`` ``None``: none).

    Attributes:
      seqs, masks: its sequences and loss masks, in order.
      asked: the prompt token tuples it asks (``loss_mask`` 0 part), not to be asked again.
      meta: its meta with fingerprint and path, recorded under ``base`` (``None`` without base).
      lines: its ``prompts.jsonl`` lines (``{}`` per sequence when the file is missing).
    Raises:
      DFlashError: ``prompts.jsonl`` does not hold one line per sequence.
    """

    def __init__(self, path: str | None):
        from dflash_jax.errors import DFlashError
        from dflash_jax.train.data import TokenDataset

        self.seqs, self.masks, self.asked, self.meta, self.lines = [], [], set(), None, []
        if path is None:
            return
        ds = TokenDataset.load(path)
        pairs = [ds.sequence(i) for i in range(len(ds))]
        self.seqs, self.masks = [t for t, _ in pairs], [m for _, m in pairs]
        self.asked = {tuple(t[m == 0].tolist()) for t, m in pairs}
        bp = Path(path) / "prompts.jsonl"
        self.lines = bp.read_text(encoding="utf-8").splitlines() if bp.is_file() else [json.dumps({})] * len(ds)
        if len(self.lines) != len(ds):
            raise DFlashError(str(bp), f"{len(self.lines)} lines", f"{len(ds)}, one per sequence of the base dataset")
        self.meta = dict(ds.meta, fingerprint=ds.fingerprint(), path=str(path))

    def save_with(self, out: Path, seqs, masks, prompts: list[dict], meta: dict):
        """Saves the base's sequences then ``seqs`` as a TokenDataset at ``out`` (``meta`` with
        ``base`` set) and ``prompts.jsonl`` (line i: the prompt of sequence i)."""
        from dflash_jax.formats.files import write_text
        from dflash_jax.train.data import TokenDataset

        ds = TokenDataset.from_sequences(self.seqs + list(seqs), self.masks + list(masks), dict(meta, base=self.meta))
        ds.save(out)
        write_text(out / "prompts.jsonl", "".join(line + "\n" for line in self.lines) + "".join(json.dumps(p) + "\n" for p in prompts))
        return ds


def _read_shard(path: Path, ids: list[list[int]], settings: str):
    """``{prompt index: sequence}`` of the answers shard at ``path`` (arrays ``index``, ``tokens``,
    ``lengths``, ``prompt_lens``) when it was made with ``settings`` (target, ``--max-new``, stop
    ids) for these prompts: every entry's index within ``ids`` must point at a prompt equal to
    the entry's prompt part (entries past ``ids``, from a run that asked more prompts, are left
    out). ``None`` for a missing or unreadable shard, or one made with other settings or prompts."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if "settings" not in z.files or z["settings"].tobytes().decode() != settings:
                return None
            shard = {k: z[k] for k in ("index", "tokens", "lengths", "prompt_lens")}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    off = np.concatenate([[0], np.cumsum(shard["lengths"])])
    out = {}
    for i, j in enumerate(shard["index"].tolist()):
        if j >= len(ids):
            continue
        seq = shard["tokens"][off[i] : off[i + 1]]
        if int(shard["prompt_lens"][i]) != len(ids[j]) or not np.array_equal(seq[: len(ids[j])], ids[j]):
            return None
        out[j] = seq
    return out


def generate_answers(target, ids: list[list[int]], todo: list[int], rows: int, refill: int, max_new: int, cap: int,
                     save, deadline: float | None = None) -> None:
    """The target's greedy answers to the prompts ``ids[j]``, ``j`` in ``todo`` (in that order),
    by continuous batching: ``rows`` rows decode together (:func:`dflash_jax.decode.loop.generate_until`);
    whenever ``refill`` of them have finished, they are handed to ``save`` and the next ``refill``
    prompts, prefilled as a batch of their own, take their rows
    (:func:`dflash_jax.decode.loop.replace_rows`), so no row idles until the longest answer ends.

    Args:
      target: a loaded target (``load_target``).
      ids: prompt token ids; ``todo``: indices of those to answer.
      rows, refill: batch rows and rows refilled at once (``1 <= refill <= rows``).
      max_new, cap: new tokens per answer at most; row capacity (longest prompt + ``max_new``).
      save: called with a list of ``(j, sequence int32 array: prompt then answer)`` as rows finish.
      deadline: ``time.time()`` after which no new prompt starts (the running ones finish), so
        the answered prompts are always the first of ``todo``.
    """
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import loop as decode
    from dflash_jax.decode.static import Decoding, Params

    params, static = Params(target.params), Decoding(target.cfg)
    queue = list(todo)

    def prefilled(idx: list[int], n: int):
        """``n`` prefilled rows answering ``idx``; padding rows (a copy of the first prompt) get
        a budget of one token, so they are done at once and free."""
        chunk = [ids[j] for j in idx] + [ids[idx[0]]] * (n - len(idx))
        st = decode.init_state(static, chunk, cap, [max_new] * len(idx) + [1] * (n - len(idx)), stop_ids=target.eos_ids)
        return decode.prefill(params, st, static, 32)

    def take(n: int) -> list[int]:
        if queue and deadline is not None and time.time() > deadline:
            print(f"time limit reached: {len(queue)} prompts not started; the running ones finish", file=sys.stderr, flush=True)
            queue.clear()
        got = queue[:n]
        del queue[:n]
        return got

    first = take(rows)
    if not first:
        return
    owner = first + [None] * (rows - len(first))
    state = prefilled(first, rows)
    while True:
        done = np.asarray(jax.device_get(state.done))
        finished = [r for r in range(rows) if owner[r] is not None and done[r]]
        if finished:
            toks, length = (np.asarray(a) for a in jax.device_get((state.tokens, state.length)))
            save([(owner[r], toks[r, : length[r]].astype(np.int32)) for r in finished])
            for r in finished:
                owner[r] = None
        free = [r for r in range(rows) if owner[r] is None]
        while len(free) >= refill and queue:
            idx = take(refill)
            if not idx:
                break
            state = decode.replace_rows(state, prefilled(idx, refill), jnp.asarray(free[:refill], jnp.int32))
            for r, j in zip(free, idx):
                owner[r] = j
            free = free[refill:]
        if all(o is None for o in owner):
            return
        done = np.asarray(jax.device_get(state.done))
        # wait for enough rows to refill at once, or for every row when nothing is left to start
        need = rows if not queue else int(done.sum()) + max(1, refill - len(free))
        state = decode.generate_until(params, state, static, jnp.int32(min(need, rows)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output dataset folder")
    ap.add_argument("--target", default=None, help="target .gguf or HF folder (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=1024,
                    help="prompts to answer: the first of the shuffled list that fit --prompt-cap and --base does not ask")
    ap.add_argument("--code-fraction", type=float, default=0.65,
                    help="share of code prompts in round 1 of the built-in list (default 0.65; round 2 is all code; unused with --sources)")
    ap.add_argument("--max-new", type=int, default=160, help="new tokens per response at most (default 160)")
    ap.add_argument("--prompt-cap", type=int, default=128, help="longest prompt in tokens; longer ones are skipped (default 128)")
    ap.add_argument("--batch-size", type=int, default=32, help="rows decoded together (default 32)")
    ap.add_argument("--refill", type=int, default=None,
                    help="finished rows given new prompts at once (continuous batching; default a quarter of --batch-size)")
    ap.add_argument("--seed", type=int, default=0, help="prompt shuffle seed (default 0)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds; no new prompt starts after this (running ones finish)")
    ap.add_argument("--sources", default=None,
                    help="comma-separated stdlib and/or installed packages: ask the target to complete their documented "
                         "functions (tools/make_code_data.py's reading, shuffled with --seed) instead of the built-in list")
    ap.add_argument("--base", default=None, help="dataset whose sequences come first; prompts it already asks are skipped")
    ap.add_argument("--list-prompts", action="store_true", help="print the shuffled prompt list (before --prompt-cap and --base) and exit")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error(f"--batch-size: got {args.batch_size}, expected an integer >= 1")
    args.refill = max(1, args.batch_size // 4) if args.refill is None else args.refill
    if not 1 <= args.refill <= args.batch_size:
        ap.error(f"--refill: got {args.refill}, expected an integer in [1, --batch-size = {args.batch_size}]")

    roots, prompts = source_prompts(args.sources, args.seed) if args.sources is not None else (None, build_prompts(args.seed, args.code_fraction))
    if args.list_prompts:
        for p in prompts[: args.num_prompts]:
            print(json.dumps(p))
        return 0

    from dflash_jax.loading import load_target
    from dflash_jax.formats.files import atomic_path, write_text

    t0 = time.time()
    target = load_target(args.target)
    tok = target.tokenizer
    out = Path(args.out)
    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    base = Base(args.base)
    selected, ids = [], []
    for p in prompts:
        if len(selected) >= args.num_prompts:
            break
        enc = tok.encode_chat([{"role": "user", "content": p["text"]}])
        if len(enc) > args.prompt_cap or tuple(enc) in base.asked:
            continue
        selected.append(p)
        ids.append(enc)
    held = held_out_prompts()
    write_text(out / "eval_prompts.json", json.dumps({"texts": held, "ids": [tok.encode_chat([{"role": "user", "content": t}]) for t in held]}, indent=1))

    cap = args.prompt_cap + args.max_new
    settings = json.dumps({"target": Path(str(target.source)).name, "max_new": args.max_new, "stop_ids": list(target.eos_ids),
                           "decoding": "greedy"}, sort_keys=True)
    answers: dict[int, np.ndarray] = {}
    numbered = {int(m.group(1)): p for p in shards.iterdir() if (m := re.fullmatch(r"answers_(\d+)\.npz", p.name))}
    if any(shards.glob("batch_*.npz")):
        print(f"{shards}: batch_*.npz shards (made before continuous batching, without prompt indices) are not read; "
              "their prompts are answered again", file=sys.stderr, flush=True)
    for _, path in sorted(numbered.items()):
        got = _read_shard(path, ids, settings)
        if got is None:
            print(f"{path} was made for other prompts or settings (another target, --max-new or recipe); not used",
                  file=sys.stderr, flush=True)
        else:
            answers.update(got)
    todo = [j for j in range(len(ids)) if j not in answers]
    if todo:
        n_shard = 1 + max(numbered, default=-1)
        pending, tg, new_tokens = [], time.time(), 0

        def save(done, final=False):
            nonlocal n_shard, new_tokens
            pending.extend(done)
            new_tokens += sum(len(s) - len(ids[j]) for j, s in done)
            if len(pending) < args.batch_size and not final:
                return
            with atomic_path(shards / f"answers_{n_shard:05d}.npz") as tmp, open(tmp, "wb") as f:
                np.savez(f, index=np.array([j for j, _ in pending], np.int64), tokens=np.concatenate([s for _, s in pending]),
                         lengths=np.array([len(s) for _, s in pending], np.int64),
                         prompt_lens=np.array([len(ids[j]) for j, _ in pending], np.int64), settings=np.frombuffer(settings.encode(), np.uint8))
            answers.update(pending)
            n_shard += 1
            pending.clear()
            el = time.time() - tg
            print(f"{len(answers)}/{len(ids)} prompts answered: {new_tokens} new tokens in {el:.0f}s ({new_tokens / el:.1f} tok/s); "
                  f"{(time.time() - t0) / 60:.1f} min elapsed", file=sys.stderr, flush=True)

        deadline = None if args.time_limit is None else t0 + args.time_limit
        generate_answers(target, ids, todo, args.batch_size, args.refill, args.max_new, cap, save, deadline)
        if pending:
            save([], final=True)

    seqs, masks, kept, seen, dropped = [], [], [], set(), 0
    for j in range(len(ids)):
        if j not in answers:
            break  # a prefix of the prompts: the dataset stays a prefix of the prompt list
        if tuple(ids[j]) in seen:  # a prompt asked twice (one method inherited by several classes): kept once
            dropped += 1
            continue
        seen.add(tuple(ids[j]))
        s = answers[j]
        seqs.append(s)
        masks.append(np.r_[np.zeros(len(ids[j]), np.uint8), np.ones(len(s) - len(ids[j]), np.uint8)])
        kept.append(dict(selected[j], prompt_tokens=len(ids[j])))
    meta = {
        "recipe": "tools/make_train_data.py",
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + list(argv if argv is not None else sys.argv[1:])),
        "target": str(target.source), "python": sys.version.split()[0], "seed": args.seed,
        "code_fraction": None if args.sources is not None else args.code_fraction,
        "max_new": args.max_new, "prompt_cap": args.prompt_cap, "batch_size": args.batch_size, "refill": args.refill,
        "decoding": "greedy",
        "chat_template": "target tokenizer's, default system prompt, one user turn", "stop_ids": list(target.eos_ids),
        "num_prompts_requested": args.num_prompts, "duplicates_dropped": dropped,
        "sources": dict(sorted(Counter(p["source"].split(":")[0] for p in kept).items())),
        "sources_read": _code_data().source_meta(roots) if roots else None,
        "heldout": "eval_prompts.json; HumanEval never used",
    }
    ds = base.save_with(out, seqs, masks, kept, meta)
    print(f"dataset: {len(ds)} sequences, {len(ds.tokens)} tokens, {int(ds.loss_mask.sum())} response tokens -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
