"""The shipped drafter's per-slot recall@k and the acceptance that trees of drafts would reach.

Issue 30 (tree verification), first step: before a tree is designed, measure how often the
target's greedy token at each draft slot is among the drafter's top k there, and how many tokens
per verify step trees of a few nodes would commit against today's chain.

For each prompt (``tools/prompts.py``: ``CODE_PROMPTS`` and ``CHAT_PROMPTS``, held out of the
drafter's training and calibration, written as users write them; chat template applied) the
default target and its shipped drafter, float32, greedy:

1. Teacher forcing along the target's own greedy continuation: after prefill (with capture), each
   step proposes the block ``[last token, MASK, ...]`` exactly as ``propose_fn`` does (the same
   lines, but keeping the drafter's full log-softmax at every slot, of which the top
   ``--topk`` are kept), then verifies no drafts (``verify_block`` with ``[B, 0]`` drafts: one
   target pass over the anchor, which commits the target's greedy token and captures its hidden
   states into the drafter context, as a plain step of ``n_max="auto"`` does). So every position
   ``t`` of the continuation is a verify point whose committed context is the greedy text up to
   ``t``; the committed tokens are the target's greedy continuation (checked against
   ``dj.generate`` without a drafter unless ``--no-check``).
2. At a verify point ``t`` (anchor ``g[t]``), slot ``j`` (1..block_size-1) drafts ``g[t + j]``; its
   rank is the position of ``g[t + j]`` in the drafter's sorted top-``--topk`` at slot ``j`` (a
   miss beyond, or when the token is outside the drafter's reduced vocabulary). A verify point
   counts when all its slots lie inside the continuation (the first ``--max-new-tokens``
   positions, before the row's stop token minus the block).

Reported per prompt set: recall@k at each slot, unconditional and given that every earlier slot's
top-1 was the greedy token (the chain reached that slot); tau (tokens committed per verify step:
accepted drafts plus the bonus) of the chain at depths 1, 3 and ``block_size - 1`` and of trees of
``--budgets`` nodes (drafted tokens, the anchor not counted; a verify pass of ``budget + 1``
tokens). A tree is built per verify point best-first from the drafter's probabilities: starting
from the anchor, always add the child, of any node already in the tree, with the highest product
of the drafter's probabilities along its path; the children of a node at depth ``d`` are the
top-k tokens of slot ``d + 1``. A DFlash drafter predicts all slots in one pass, and slot ``j``'s
distribution does not depend on which token an earlier slot took, so every node at depth ``d``
has the same candidate children: a tree is a prefix-closed set of paths over the per-slot top-k
lists, at most ``block_size - 1`` deep. Under teacher forcing its acceptance at a verify point is
the depth of the deepest node whose path is the greedy continuation, plus 1 for the bonus token.
A static tree (one shape for every verify point: the ``budget`` rank paths most often on the
greedy continuation) is fit, for each prompt, on the set's other prompts (leave one prompt out;
in-sample when a set has one prompt). Nothing is timed. Results go to ``--output`` (a section for BENCHMARKS.md)::

    python tools/bench_recall.py --prompts code:8,chat:8 --max-new-tokens 128 --output /tmp/recall_section.md
    python tools/bench_recall.py --prompts 2 --max-new-tokens 32 --no-check       # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import int_list, machine  # noqa: E402
from prompts import CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402

SETS = {"code": CODE_PROMPTS, "chat": CHAT_PROMPTS}
KS = tuple(range(1, 9))
CHAIN_DEPTHS = (1, 3)  # plus block_size - 1; today's verify widths (depth.verify_widths)


def parse_prompts(text: str) -> list[tuple[str, int]]:
    """``"code:8,chat:8"`` -> ``[("code", 8), ("chat", 8)]``; a bare ``"8"``: 8 of each set."""
    if text.isdigit():
        return [(name, int(text)) for name in SETS]
    out = []
    for item in text.split(","):
        name, _, count = item.partition(":")
        if name not in SETS or not count.isdigit() or int(count) < 1 or int(count) > len(SETS[name]):
            raise argparse.ArgumentTypeError(f"expected SET:N with SET in {', '.join(SETS)} and N in 1..16 (or one N), got {item!r}")
        out.append((name, int(count)))
    return out


def build_fns(static, topk: int):
    """``(slot_topk, advance)``: the jitted drafter pass that returns ``(ids [B, n, topk] int32,
    logp [B, n, topk] float32)`` per draft slot, sorted by probability (the pass propose_fn
    drafts from, :func:`~dflash_jax.decode.step.draft_logits`), and one verify of no
    drafts (commits the greedy token)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import step as speculative
    from dflash_jax.drafter import model as drafter
    from dflash_jax.decode.step import draft_logits

    @jax.jit
    def slot_topk(params, state):
        logp = jax.nn.log_softmax(draft_logits(params, state, static)[0], axis=-1)
        top, idx = jax.lax.top_k(logp, topk)
        return drafter.draft_token_ids(params.drafter, static.drafter, idx), top

    def advance(params, state):
        b = state.tokens.shape[0]
        return speculative.verify_block(params, state, static, jnp.zeros((b, 0), jnp.int32))

    return slot_topk, advance


def teacher_forced(target, drafter, prompts: list[list[int]], max_new: int, topk: int):
    """Runs one batch along the greedy continuation. Returns ``(greedy, ids, logp)`` per row:
    ``greedy [N]`` the committed continuation (first token: prefill's; ends at a stop id or after
    ``max_new + block_size - 1`` tokens), ``ids``/``logp`` ``[T, n, topk]`` the drafter's top-k at
    verify points ``t = 0..T-1`` (anchor ``greedy[t]``)."""
    import jax

    from dflash_jax.decode import loop as decode
    from dflash_jax.decode.static import Decoding, Params

    n = drafter.cfg.block_size - 1
    static = Decoding(target.cfg, drafter.cfg, n_max=n)
    params = Params(target.params, drafter.params)
    budget = max_new + n  # every verify point t < max_new sees n slots of continuation
    capacity = max(len(p) for p in prompts) + budget + drafter.cfg.block_size
    state = decode.init_state(static, prompts, capacity, budget, target.eos_ids)
    state = decode.prefill(params, state, static, chunk_size=64)
    slot_topk, advance = build_fns(static, topk)
    ids, logp = [], []
    for _ in range(max_new):
        i, lp = slot_topk(params, state)
        ids.append(i)
        logp.append(lp)
        state = advance(params, state)
    for _ in range(n - 1):  # the rest of the continuation the last verify points look at
        state = advance(params, state)
    tokens, prompt_len, length = jax.device_get((state.tokens, state.prompt_len, state.length))
    ids, logp = np.stack(jax.device_get(ids), axis=1), np.stack(jax.device_get(logp), axis=1)
    rows = []
    for b in range(len(prompts)):
        greedy = tokens[b, prompt_len[b] : length[b]]
        rows.append((greedy, ids[b], logp[b]))
    return rows


def verify_points(rows, max_new: int, n: int):
    """``(ranks [P, n] int, logp [P, n, topk], owner [P])`` over every counted verify point of
    ``rows``: ``ranks[p, j]`` is the rank of the greedy token of slot ``j + 1`` in the drafter's
    top-k (``topk``: a miss), ``owner[p]`` the row of the point."""
    ranks, logps, owner = [], [], []
    for row, (greedy, ids, logp) in enumerate(rows):
        topk = ids.shape[-1]
        last = min(max_new, len(greedy) - n)  # t + n <= len(greedy) - 1: all n slots inside
        for t in range(max(last, 0)):
            want = greedy[t + 1 : t + 1 + n]
            hit = ids[t] == want[:, None]  # [n, topk]
            ranks.append(np.where(hit.any(axis=1), hit.argmax(axis=1), topk))
            logps.append(logp[t])
            owner.append(row)
    return np.array(ranks, np.int64).reshape(-1, ids.shape[1]), np.array(logps).reshape(-1, ids.shape[1], topk), np.array(owner)


def best_first_tree(logp: np.ndarray, budget: int) -> set:
    """The ``budget`` rank paths (tuples) that best-first expansion adds: always the frontier child
    of highest path probability. ``logp [n, topk]`` sorted per slot, so a node's best child is rank
    0 at the next slot and after a node at rank ``r`` the next candidate among its siblings is ``r + 1``."""
    n, topk = logp.shape
    tree, heap = set(), [(-logp[0, 0], (0,))]
    while heap and len(tree) < budget:
        neg, path = heapq.heappop(heap)
        tree.add(path)
        d, r = len(path), path[-1]
        if d < n:
            heapq.heappush(heap, (neg - logp[d, 0], path + (0,)))
        if r + 1 < topk:
            heapq.heappush(heap, (neg + logp[d - 1, r] - logp[d - 1, r + 1], path[:-1] + (r + 1,)))
    return tree


def accepted(tree: set, ranks) -> int:
    """Drafts accepted: the depth of the deepest node of ``tree`` on the greedy rank path."""
    d = 0
    while d < len(ranks) and tuple(ranks[: d + 1]) in tree:
        d += 1
    return d


def static_tree(ranks: np.ndarray, budget: int, topk: int) -> set:
    """The ``budget`` rank-path prefixes most often on the greedy continuation (prefix-closed,
    since a prefix is on it at least as often as any extension), over ranks below ``topk`` (a
    miss is no node)."""
    counts: dict = {}
    for r in ranks:
        for d in range(1, len(r) + 1):
            if r[d - 1] >= topk:
                break
            key = tuple(int(x) for x in r[:d])
            counts[key] = counts.get(key, 0) + 1
    order = sorted(counts, key=lambda k: (-counts[k], len(k), k))
    return set(order[:budget])


def analyse(ranks: np.ndarray, logp: np.ndarray, owner: np.ndarray, budgets) -> dict:
    """Recall tables and tau of chains and trees for one set's verify points (``owner [P]``: the
    prompt of each; a static tree for a prompt's points is fit on the set's other prompts)."""
    p, n = ranks.shape
    uncond = np.array([[np.mean(ranks[:, j] < k) for k in KS] for j in range(n)])
    chain_ok = np.cumprod(ranks == 0, axis=1)  # [P, n]: slots 1..j all top-1
    reach = np.concatenate([np.ones((p, 1), bool), chain_ok[:, :-1].astype(bool)], axis=1)
    cond = np.array([[np.mean(ranks[reach[:, j], j] < k) if reach[:, j].any() else np.nan for k in KS] for j in range(n)])
    reached = reach.sum(axis=0)
    chains = {d: 1 + chain_ok[:, :d].sum(axis=1).mean() for d in (*CHAIN_DEPTHS, n)}
    trees, shapes, statics = {}, {}, {}
    for b in budgets:
        acc, per_depth = [], np.zeros(n)
        for i in range(p):
            tree = best_first_tree(logp[i], b)
            acc.append(accepted(tree, ranks[i]))
            for path in tree:
                per_depth[len(path) - 1] += 1
        trees[b] = 1 + np.mean(acc)
        shapes[b] = per_depth / p
        acc = np.zeros(p)
        for o in np.unique(owner):
            fit = ranks[owner != o] if (owner != o).any() else ranks  # one prompt alone: in-sample
            st = static_tree(fit, b, logp.shape[-1])
            acc[owner == o] = [accepted(st, r) for r in ranks[owner == o]]
        statics[b] = 1 + acc.mean()
    # the ceiling of any tree over these top-k lists: every slot within top-k
    return dict(points=p, uncond=uncond, cond=cond, reached=reached, chains=chains, trees=trees, shapes=shapes, statics=statics)


def recall_table(name: str, res: dict, n: int) -> str:
    head = "| slot | verify points reaching it (chain) | " + " | ".join(f"@{k}" for k in KS) + " |"
    lines = [head, "|" + "---|" * (len(KS) + 2)]
    for j in range(n):
        u = " | ".join(f"{res['uncond'][j, i]:.3f}" for i in range(len(KS)))
        lines.append(f"| {j + 1} (all) | {res['points']} | {u} |")
    for j in range(n):
        c = " | ".join("-" if np.isnan(res['cond'][j, i]) else f"{res['cond'][j, i]:.3f}" for i in range(len(KS)))
        lines.append(f"| {j + 1} (earlier slots top-1) | {res['reached'][j]} | {c} |")
    return f"Recall@k, {name} ({res['points']} verify points): the fraction of verify points whose greedy token at the slot is in the drafter's top k there; \"all\": every verify point; \"earlier slots top-1\": only those where the chain reached the slot.\n\n" + "\n".join(lines)


def tau_table(results: dict, n: int, budgets, fit_note: str) -> str:
    names = list(results)
    lines = ["| drafts | verify pass (tokens) | " + " | ".join(f"tau {s}" for s in names) + " |", "|" + "---|" * (len(names) + 2)]
    for d in (*CHAIN_DEPTHS, n):
        lines.append(f"| chain of {d} (top-1 per slot{', today' if d == n else ''}) | {d + 1} | " + " | ".join(f"{results[s]['chains'][d]:.3f}" for s in names) + " |")
    for b in budgets:
        lines.append(f"| best-first tree of {b} nodes | {b + 1} | " + " | ".join(f"{results[s]['trees'][b]:.3f}" for s in names) + " |")
    for b in budgets:
        lines.append(f"| static tree of {b} nodes ({fit_note}) | {b + 1} | " + " | ".join(f"{results[s]['statics'][b]:.3f}" for s in names) + " |")
    lines.append("| every path over the top-k lists (k ** depth nodes), k = 1 / 2 / 4 | - | " + " | ".join(
        "{:.3f}".format(results[s]['chains'][n]) + " / " + " / ".join(f"{results[s]['ceil'][k]:.3f}" for k in (2, 4)) for s in names) + " |")
    shapes = ["| tree | " + " | ".join(f"nodes at depth {d}" for d in range(1, n + 1)) + " |", "|" + "---|" * (n + 1)]
    for s in names:
        for b in budgets:
            shapes.append(f"| {s}, {b} nodes | " + " | ".join(f"{x:.2f}" for x in results[s]['shapes'][b]) + " |")
    return "\n".join(lines) + "\n\nMean shape of the best-first trees (nodes per depth):\n\n" + "\n".join(shapes)


def ceiling(ranks: np.ndarray, k: int) -> float:
    """tau if every path over the top-k lists were verified (k ** depth nodes): 1 + the leading
    slots within top k."""
    return 1 + np.cumprod(ranks < k, axis=1).sum(axis=1).mean()


def check_greedy(target, prompts, rows, max_new: int) -> tuple[int, int]:
    """How many rows' first ``max_new`` committed tokens equal ``dj.generate`` without a drafter."""
    import dflash_jax as dj

    same = 0
    for ids, (greedy, _, _) in zip(prompts, rows):
        ref = dj.generate(target, [ids], max_new_tokens=max_new).output_ids[0]
        same += list(greedy[: len(ref)]) == list(ref)
    return same, len(prompts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=parse_prompts, default=parse_prompts("code:8,chat:8"),
                   help="SET:N,... (sets: code, chat; the first N prompts of each) or one N for every set (default code:8,chat:8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="verify points per prompt (the greedy continuation runs block_size - 1 further)")
    p.add_argument("--budgets", type=int_list, default=[3, 4, 7, 8, 16], help="tree node budgets (drafted tokens per verify)")
    p.add_argument("--topk", type=int, default=16, help="candidates kept per slot (>= the largest budget and 8)")
    p.add_argument("--no-check", action="store_true", help="skip the check against dj.generate's plain greedy output")
    p.add_argument("--output", default=None, help="write the section here (default: print only)")
    args = p.parse_args(argv)
    args.topk = max(args.topk, max(args.budgets), max(KS))
    t0 = time.time()

    import dflash_jax as dj

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    n = drafter.cfg.block_size - 1
    points, checks, oov = {}, {}, {}
    for name, count in args.prompts:
        prompts = [dj.encode_prompt(target, text) for text in SETS[name][:count]]
        rows = teacher_forced(target, drafter, prompts, args.max_new_tokens, args.topk)
        points[name] = (verify_points(rows, args.max_new_tokens, n), [len(g) for g, _, _ in rows], count)
        if drafter.cfg.draft_vocab_size:  # greedy tokens no slot can draft: outside the reduced vocabulary
            vocab = set(np.asarray(drafter.params["draft_ids"]).tolist())
            toks = [int(x) for g, _, _ in rows for x in g[1:]]
            oov[name] = sum(x not in vocab for x in toks) / max(len(toks), 1)
        if not args.no_check:
            checks[name] = check_greedy(target, prompts, rows, args.max_new_tokens)
        print(f"{name}: {len(points[name][0][0])} verify points ({time.time() - t0:.0f} s)", file=sys.stderr)
    names = list(points)
    results = {}
    for name in names:
        (ranks, logp, owner), _, _ = points[name]
        results[name] = analyse(ranks, logp, owner, args.budgets)
        results[name]['ceil'] = {k: ceiling(ranks, k) for k in (2, 4)}
    fit_note = "shape fit on the set's other prompts"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = machine()
    cmd = shlex.join(["python", "tools/bench_recall.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    sets = "; ".join(f"{s} {points[s][2]} prompts, {results[s]['points']} verify points, continuations of {min(points[s][1])}-{max(points[s][1])} tokens" for s in names)
    check = "; ".join(f"{s}: {a} / {b} rows equal to `dj.generate` without a drafter" for s, (a, b) in checks.items()) or "not checked (`--no-check`)"
    outside = "; ".join(f"{s} {100 * f:.1f} %" for s, f in oov.items()) or "none (no reduced vocabulary)"
    recall = "\n\n".join(recall_table(s, results[s], n) for s in names)
    text = f"""## Drafter recall@k and tree acceptance (tools/bench_recall.py)

`{cmd}` ({when}, commit {rev}, {time.time() - t0:.0f} s); the default target (float32) and its shipped drafter
(block {drafter.cfg.block_size}: {n} draft slots, draft vocabulary {drafter.cfg.draft_vocab_size or 'none'}), greedy. Prompts: `tools/prompts.py`'s
`CODE_PROMPTS` and `CHAT_PROMPTS` (held out, written as users write them), chat template applied; {sets}.
Teacher forcing: every position t < {args.max_new_tokens} of the target's greedy continuation is a verify point, with the
greedy text up to t committed and the drafter run on `[g[t], MASK x {n}]` as `propose_fn` runs it (greedy check: {check}).
A continuation runs {n} tokens past the last verify point. Greedy tokens outside the drafter's reduced vocabulary (no
slot can draft them): {outside}.
Nothing is timed. A DFlash drafter predicts its {n} slots in one pass and slot j's distribution does not depend on the
token chosen at an earlier slot, so a tree here is a prefix-closed set of paths over the per-slot top-k lists (every
node at depth d has the same candidate children, slot d + 1's top-k), at most {n} deep; tau = accepted drafts + 1 (the
bonus): the depth of the deepest node on the greedy continuation, plus 1. Best-first tree: per verify point, always
add the frontier child of highest product of the drafter's probabilities along its path (the anchor is not counted
in the budget). Static tree: one shape for every verify point, the rank paths most often on the greedy continuation
of the set's other prompts (leave one prompt out).

{recall}

Tokens committed per verify step (tau) by chains and trees:

{tau_table(results, n, args.budgets, fit_note)}

Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['device']}; Python {m['python']}, jax {m['jax']}.
"""
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
