"""Making a training dataset for ``dflash-jax train`` (``dflash-jax make-data``): the recipes.

* :func:`make_distilled` (``--answers target``, self-distillation): prompts of
  :mod:`dflash_jax.train.prompt_lists`; responses are the target's own greedy continuation
  (SmolLM2-135M-Instruct by default) of each prompt rendered with its chat template (default
  system prompt), by continuous batching with ``dflash_jax.decode.loop`` (``batch_size`` rows of
  ``prompt_cap + max_new`` slots; finished rows take the next prompts ``refill`` at a time),
  stopping at the tokenizer's end-of-generation ids (the stop token is kept). Generation is
  resumable: answers are saved under ``<out>/shards/`` (``answers_*.npz``, about ``batch_size`` at
  a time, each with its prompt's index) and not asked again on a rerun; ``time_limit`` stops
  starting new prompts (the running ones finish), and the dataset is the longest prefix of the
  prompt list answered;
* :func:`make_from_source` (``--answers source``): real functions of the standard library or of
  installed packages (:mod:`dflash_jax.train.source_code`) asked as HumanEval asks, answered with
  their own source (no generation; train with ``--labels target``);
* with a ``base`` dataset (:class:`Base`) its sequences come first and the prompts it already asks
  are skipped, so one feature cache serves both and its rows are reused.

Both store token ids (prompt + response) with ``loss_mask`` 1 on the response
(:class:`dflash_jax.train.data.TokenDataset`), each distinct prompt once, plus ``prompts.jsonl``
(line i: the prompt of sequence i) and ``eval_prompts.json`` (held-out, never trained on; HumanEval
is never read). The recipe is deterministic and recorded in ``<out>/meta.json``.
"""

from __future__ import annotations

import json
import re
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

from dflash_jax.train.prompt_lists import COMPLETE, build_prompts, held_out_prompts, source_prompts
from dflash_jax.train.source_code import EVAL_MODULES, source_functions, source_meta


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
    from dflash_jax.decode.state import Decoding, Params

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


def prompt_list(args) -> tuple[dict | None, list[dict]]:
    """``(roots, prompts)`` of the self-distillation recipe: :func:`source_prompts` over
    ``args.sources`` when set, else ``(None, build_prompts(args.seed, args.code_fraction))``."""
    if args.sources is not None:
        return source_prompts(args.sources, args.seed)
    return None, build_prompts(args.seed, args.code_fraction)


def _select(prompts: list[dict], tok, base: Base, num: int, cap: int) -> tuple[list[dict], list[list[int]]]:
    """The first ``num`` prompts that fit ``cap`` tokens and ``base`` does not ask, and their ids."""
    selected, ids = [], []
    for p in prompts:
        if len(selected) >= num:
            break
        enc = tok.encode_chat([{"role": "user", "content": p["text"]}])
        if len(enc) > cap or tuple(enc) in base.asked:
            continue
        selected.append(p)
        ids.append(enc)
    return selected, ids


def _read_shards(shards: Path, ids: list[list[int]], settings: str) -> tuple[dict, dict]:
    """``(answers, numbered)``: the answers of every usable ``answers_*.npz`` shard (others are
    named on stderr and left alone) and ``{shard number: path}`` of all of them."""
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
    return answers, numbered


def _answer_missing(target, ids, answers: dict, numbered: dict, shards: Path, settings: str, args, t0: float) -> None:
    """Generates the answers missing from ``answers`` (:func:`generate_answers`), saving them as
    new shards about ``args.batch_size`` at a time and adding them to ``answers``."""
    from dflash_jax.formats.files import atomic_path

    todo = [j for j in range(len(ids)) if j not in answers]
    if not todo:
        return
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
    generate_answers(target, ids, todo, args.batch_size, args.refill, args.max_new, args.prompt_cap + args.max_new, save, deadline)
    if pending:
        save([], final=True)


def _answered_prefix(ids, answers: dict, selected: list[dict]):
    """``(seqs, masks, kept, dropped)``: the longest answered prefix of the prompts, each distinct
    prompt once (a few coincide: one method inherited by several classes; ``dropped`` counts them)."""
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
    return seqs, masks, kept, dropped


def make_distilled(args, command: str):
    """Self-distillation (module docstring): writes the dataset to ``args.out`` and returns it
    (:class:`~dflash_jax.train.data.TokenDataset`).

    Args:
      args: ``out``, ``target`` (path or ``None``: the embedded default), ``num_prompts``,
        ``code_fraction``, ``max_new``, ``prompt_cap``, ``batch_size``, ``refill``, ``seed``,
        ``time_limit`` (seconds or ``None``), ``sources`` (or ``None``), ``base`` (or ``None``),
        as ``dflash-jax make-data`` names them.
      command: the command line, recorded in ``meta.json``.
    Raises:
      DFlashError: a bad ``sources`` value, or a base dataset that does not load.
    """
    from dflash_jax.formats.files import write_text
    from dflash_jax.loading import load_target

    t0 = time.time()
    roots, prompts = prompt_list(args)
    target = load_target(args.target)
    tok = target.tokenizer
    out = Path(args.out)
    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    base = Base(args.base)
    selected, ids = _select(prompts, tok, base, args.num_prompts, args.prompt_cap)
    held = held_out_prompts()
    write_text(out / "eval_prompts.json", json.dumps({"texts": held, "ids": [tok.encode_chat([{"role": "user", "content": t}]) for t in held]}, indent=1))
    settings = json.dumps({"target": Path(str(target.source)).name, "max_new": args.max_new, "stop_ids": list(target.eos_ids),
                           "decoding": "greedy"}, sort_keys=True)
    answers, numbered = _read_shards(shards, ids, settings)
    _answer_missing(target, ids, answers, numbered, shards, settings, args, t0)
    seqs, masks, kept, dropped = _answered_prefix(ids, answers, selected)
    meta = {
        "recipe": "dflash-jax make-data (tools/make_train_data.py until commit 9868b87)",
        "command": command,
        "target": str(target.source), "python": sys.version.split()[0], "seed": args.seed,
        "code_fraction": None if args.sources is not None else args.code_fraction,
        "max_new": args.max_new, "prompt_cap": args.prompt_cap, "batch_size": args.batch_size, "refill": args.refill,
        "decoding": "greedy",
        "chat_template": "target tokenizer's, default system prompt, one user turn", "stop_ids": list(target.eos_ids),
        "num_prompts_requested": args.num_prompts, "duplicates_dropped": dropped,
        "sources": dict(sorted(Counter(p["source"].split(":")[0] for p in kept).items())),
        "sources_read": source_meta(roots) if roots else None,
        "heldout": "eval_prompts.json; HumanEval never used",
    }
    ds = base.save_with(out, seqs, masks, kept, meta)
    print(f"dataset: {len(ds)} sequences, {len(ds.tokens)} tokens, {int(ds.loss_mask.sum())} response tokens -> {out}", file=sys.stderr)
    return ds


def make_from_source(args, command: str):
    """Code-completion data from real source (module docstring): writes the dataset to
    ``args.out`` and returns it.

    Args:
      args: ``out``, ``base`` (or ``None``), ``target`` (its tokenizer; ``None``: the embedded
        default), ``num_sequences`` (0: every function that fits), ``max_len`` (longest sequence
        in tokens), ``sources`` (comma-separated), ``seed``.
      command: the command line, recorded in ``meta.json``.
    Raises:
      DFlashError: a target without the ChatML end-of-turn token, a bad ``sources`` value, or a
        base dataset that does not load.
    """
    from dflash_jax.errors import DFlashError
    from dflash_jax.formats.files import write_text
    from dflash_jax.loading import load_target

    target = load_target(args.target)
    tok = target.tokenizer
    end = tok.token_to_id("<|im_end|>")
    if end is None or end not in target.eos_ids:
        raise DFlashError(f"{target.source}: tokenizer", "no <|im_end|> end-of-turn token among the stop ids", "a ChatML target")
    roots, items = source_functions(args.sources, args.seed)
    base = Base(args.base)
    seen = set(base.asked)  # a prompt the base already asks is not asked again
    seqs, masks, kept = [], [], []
    for it in items:
        if args.num_sequences and len(kept) >= args.num_sequences:
            break
        prompt = tok.encode_chat([{"role": "user", "content": COMPLETE.format(stub=it["stub"])}])
        if len(prompt) >= args.max_len or tuple(prompt) in seen:
            continue
        answer = tok.encode(f"```python\n{it['code']}\n```", add_bos=False) + [end]
        if len(prompt) + len(answer) > args.max_len:
            continue
        seen.add(tuple(prompt))
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
        kept.append({"source": it["source"], "kind": "complete-source"})
    if len(kept) < args.num_sequences:
        print(f"note: only {len(kept)} functions fit --max-len {args.max_len}", file=sys.stderr)
    meta = {
        "recipe": "dflash-jax make-data --answers source (tools/make_code_data.py until commit 9868b87)",
        "command": command,
        "target": str(target.source), "python": sys.version.split()[0], "seed": args.seed,
        "sources": source_meta(roots),
        "max_len": args.max_len, "code_sequences": len(kept),
        "code_tokens": int(sum(len(s) for s in seqs)),
        "labels": "train with --labels target: answers are real source, not the target's output",
        "chat_template": "target tokenizer's, default system prompt, one user turn",
        "heldout": "modules " + ", ".join(EVAL_MODULES) + "; HumanEval never used",
    }
    out = Path(args.out)
    ds = base.save_with(out, seqs, masks, kept, meta)
    if args.base and (Path(args.base) / "eval_prompts.json").is_file():
        write_text(out / "eval_prompts.json", (Path(args.base) / "eval_prompts.json").read_text(encoding="utf-8"))
    print(f"dataset: {len(ds)} sequences ({len(kept)} code), {len(ds.tokens)} tokens, {int(ds.loss_mask.sum())} supervised -> {out}",
          file=sys.stderr)
    return ds
