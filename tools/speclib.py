"""The speculative-decoding benchmark's machinery (tools/bench_spec.py): configurations (plain,
every fixed depth, auto), their loops compiled ahead of time, prefilled states, timed runs, and
continuous batching (:func:`run_continuous`), what a server runs at a batch of ``B`` slots.

Continuous batching: each configuration keeps its own state of ``B`` rows. Its compiled loop
(:func:`dflash_jax.decode.loop.generate_until`) runs until one more row finishes; the finished rows are
read and replaced by the next prompts of the set (:func:`dflash_jax.decode.loop.replace_rows`), taken
cyclically, so every slot stays busy to the end (a server under load) and no row waits for the
longest of its batch. A configuration stops once every prompt of the set has finished; the tokens
of the rows still running then (prompts taken again) count as far as they got. The
configurations take turns in segments of ``B`` finished rows (a different one first each round),
so the machine's load changes fall on all of them. Each loop runs once untimed first; then only
the loop's calls are timed (prefill and replacing rows are not: the same for every
configuration). Each prompt is prefilled once for plain decoding and once with capture, shared by
the configurations that reach it.
"""

from __future__ import annotations

import time

import numpy as np

TIE_GAP = 1e-3  # a first difference at a step whose top-2 logit gap is below this is a near-tie


def configs(drafter) -> list:
    return ["plain", *range(1, drafter.cfg.block_size), "auto"]


def setup(target, drafter, config):
    """``(static, params)`` of one configuration (``params.depth`` is filled in later for auto)."""
    from dflash_jax.decode.state import Decoding, Params

    if config == "plain":
        return Decoding(target.cfg), Params(target.params)
    if not is_auto(config):
        return Decoding(target.cfg, drafter.cfg, n_max=config), Params(target.params, drafter.params)
    # "auto": the drafter's default (its recorded auto_depth and tree); "auto@K": over blocks of K tokens (K - 1 drafts)
    if config == "auto":
        from dflash_jax.arguments import drafter_decoding

        return drafter_decoding(target.cfg, drafter, n_max="auto", tree=drafter.tree or 0), Params(target.params, drafter.params)
    return Decoding(target.cfg, drafter.cfg, n_max="auto", auto_depth=int(config[5:]) - 1), Params(target.params, drafter.params)


def is_auto(config) -> bool:
    """Whether ``config`` names auto (``"auto"``, or ``"auto@K"``: auto over blocks of ``K`` tokens)."""
    return isinstance(config, str) and config.startswith("auto")


def fresh_state(target, static, params, prompts, args, capacity):
    from dflash_jax.decode import loop as decode

    st = decode.init_state(static, prompts, capacity, args.max_new_tokens, target.eos_ids)
    return decode.prefill(params, st, static, 256, max(len(p) for p in prompts))


def compile_all(target, drafter, prompts, args, capacity, names=None):
    """For one (batch, capacity): every configuration's loop (or those of ``names``) compiled
    ahead of time, and auto's cost model (kept on disk or measured with its own loop, as the API
    does)."""
    import jax.numpy as jnp

    from dflash_jax.decode.auto import costs
    from dflash_jax.decode import loop as decode
    from dflash_jax.decode.auto.policy import Calibration

    out = {}
    for config in names or configs(drafter):
        static, params = setup(target, drafter, config)
        if is_auto(config):
            n, widths = static.depth, static.auto_widths
            calibration = drafter.calibration or Calibration.identity(n)  # depth_policy takes its first n positions
            params = params._replace(depth=costs.depth_policy(calibration, costs.CostModel.forcing(widths[-1], widths[-1], widths), depth=n))
        st = fresh_state(target, static, params, prompts, args, capacity)
        rows = jnp.int32(len(prompts))
        loop = decode.generate_until.lower(params, st, static, rows).compile()
        run = lambda p, s, loop=loop, rows=rows: loop(p, s, rows)  # noqa: E731
        if is_auto(config):
            key = costs.cost_key(static, params, len(prompts), (target.source, drafter.source))
            model = costs.cost_model_for(key, lambda: costs.measure(run, params, st, static), refresh=args.measure_costs, widths=widths)
            params = params._replace(depth=costs.depth_policy(calibration, model, depth=n))
            out["cost_model"] = model
        out[config] = (static, params, run, loop)
    return out


def prefilled(target, prepared, prompts, args, capacity) -> dict:
    """The batch prefilled once for plain decoding and once with the drafter's capture (every
    DFlash configuration starts from a copy of the latter: prefill does not depend on n_max)."""
    return {kind: fresh_state(target, *prepared[config][:2], prompts, args, capacity) for kind, config in (("plain", "plain"), ("dflash", "auto"))}


def state_for(states: dict, static):
    """A copy of the prefilled state for ``static`` (its statistics shaped for its ``n_max``);
    a shape that does not fit the compiled loop would make the loop raise."""
    import jax
    import jax.numpy as jnp

    if not static.speculative:
        return jax.tree.map(lambda x: jnp.array(x, copy=True), states["plain"])
    st = jax.tree.map(lambda x: jnp.array(x, copy=True), states["dflash"])
    sp, n = st.speculative, static.depth
    return st.replace(speculative=sp.replace(accepted_per_position=jnp.zeros((sp.accepted.shape[0], n), jnp.int32),
                                             widths=jnp.zeros((n + 1,), jnp.int32)))


def run_config(prepared, config, states):
    """One timed generation of a batch: ids, gaps, seconds, decode tokens and statistics."""
    import jax

    from dflash_jax.runtime.compiled import count_compilations

    static, params, run, _ = prepared[config]
    st = state_for(states, static)
    jax.block_until_ready(st)
    with count_compilations() as compiled:
        t0, c0 = time.perf_counter(), time.process_time()
        st = jax.block_until_ready(run(params, st))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        n_compiled = compiled()
    tokens, gaps, length, steps, prompt_len = jax.device_get((st.tokens, st.gaps, st.length, st.steps, st.prompt_len))
    rows = []
    for b, p in enumerate(prompt_len):
        rows.append(dict(ids=tokens[b, p : length[b]].tolist(), gaps=gaps[b, p : length[b]].tolist()))
    rec = dict(rows=rows, seconds=dt, cpu=cpu, decode_tokens=int(sum(len(r["ids"]) for r in rows)) - len(rows), steps=int(steps),
               compiled=n_compiled)
    if static.speculative:
        sp, committed = jax.device_get((st.speculative, st.committed))
        rec.update(passes=int(np.sum(sp.verify_steps)), committed=int(np.sum(committed)), widths=sp.widths.tolist())
    return rec


def compare(plain, other) -> str:
    """``"equal"``, ``"tie"`` (first difference at a near-tie) or ``"MISMATCH"``."""
    a, b = plain["ids"], other["ids"]
    if a == b:
        return "equal"
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return "tie" if (plain["gaps"][i] if i < len(plain["gaps"]) else 0.0) < TIE_GAP else "MISMATCH"



def _row_state(target, prepared, prompt, kind, args, capacity):
    """One prompt prefilled for ``kind`` (``"plain"`` or ``"dflash"``), a state of one row."""
    config = "plain" if kind == "plain" else "auto"
    return fresh_state(target, *prepared[config][:2], [prompt], args, capacity)


class _Prefills:
    """Prefilled one-row states by prompt index, made on first use and dropped once every
    configuration that needs them has taken them (configurations advance in step, so few are held)."""

    def __init__(self, target, prepared, prompts, args, capacity, users: dict):
        self.target, self.prepared, self.prompts, self.args, self.capacity = target, prepared, prompts, args, capacity
        self.users, self.held = users, {}

    def take(self, i: int, kind: str):
        key = (i, kind)
        if key not in self.held:
            self.held[key] = [_row_state(self.target, self.prepared, self.prompts[i % len(self.prompts)], kind, self.args, self.capacity),
                              self.users[kind]]
        entry = self.held[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.held[key]
        return entry[0]


def _copy_for(state, static):
    """A copy of a prefilled one-row state shaped for ``static`` (:func:`state_for`)."""
    return state_for({"plain": state, "dflash": state}, static)


def _finish_row(st, b: int) -> dict:
    """Row ``b``'s generated ids and top-2 logit gaps (:func:`compare`'s input)."""
    tokens, gaps, length, prompt_len = (np.asarray(x) for x in (st.tokens[b], st.gaps[b], st.length[b], st.prompt_len[b]))
    return dict(ids=tokens[prompt_len:length].tolist(), gaps=gaps[prompt_len:length].tolist())


def _segment(run: dict, s: dict, prep, pool, batch: int, n_prompts: int) -> None:
    """Advances one configuration by ``batch`` finished rows, or until every prompt of the set has
    finished: timed loop calls until a row finishes, each finished row read and replaced by the
    next prompt."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import loop as decode
    from dflash_jax.runtime.compiled import count_compilations

    static, params, _, loop = prep
    goal = run["finished"] + batch
    seconds = tokens = 0
    while run["finished"] < goal and len(run["outputs"]) < n_prompts:
        st = run["state"]
        before = jax.device_get((st.length, st.steps, None if st.speculative is None else st.speculative.verify_steps))
        with count_compilations() as compiled:
            t0, c0 = time.perf_counter(), time.process_time()
            st = jax.block_until_ready(loop(params, st, jnp.int32(1)))
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            s["compiled"] += compiled()
        after = jax.device_get((st.length, st.steps, None if st.speculative is None else st.speculative.verify_steps))
        new = int(np.sum(after[0] - before[0]))
        seconds, tokens = seconds + dt, tokens + new
        s["seconds"] += dt
        s["cpu"] += cpu
        s["tokens"] += new
        s["steps"] += int(after[1] - before[1])
        if after[2] is not None:
            s["passes"] += int(np.sum(after[2] - before[2]))
            s["committed"] += new
        for b in np.flatnonzero(np.asarray(jax.device_get(st.done))):
            i = run["slot"][b]
            if i < n_prompts:
                run["outputs"][i] = _finish_row(st, int(b))
            run["finished"] += 1
            run["slot"][b] = run["next"]
            fresh = _copy_for(pool.take(run["next"], run["kind"]), static)
            run["next"] += 1
            st = decode.replace_rows(st, fresh, jnp.asarray([b], jnp.int32))
        run["state"] = st
    s["per_batch"].append((tokens, seconds))


def run_continuous(target, drafter, name, prompts, batch, args, variants: dict | None = None, fixed=()) -> dict:
    """Every configuration under continuous batching over one set: the dict of
    ``bench_spec.run_set`` (sums per configuration; its "batches" are segments of ``batch``
    finished rows). ``variants`` (name -> fields of auto's ``DepthPolicy``, such as
    ``dict(max_backoff=16, pay_margin=0.15)``, and ``raw=True`` for the identity calibration):
    plain decoding, the fixed depths ``fixed`` and these variants of auto, sharing auto's compiled
    loop and cost model, instead of plain, every fixed depth and auto."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode.auto import costs
    from dflash_jax.arguments import default_max_len
    from dflash_jax.decode.auto.policy import Calibration

    capacity = default_max_len(prompts, args.max_new_tokens)
    if variants:
        names = ["plain", *fixed, *variants]
        prepared = compile_all(target, drafter, prompts[:batch], args, capacity, ["plain", *fixed, "auto"])
        static, params, run, loop = prepared["auto"]  # kept: the prefills read it
        identity = Calibration.identity(static.depth)
        for v, fields in variants.items():
            fields = dict(fields)
            calibration = identity if fields.pop("raw", False) else drafter.calibration or identity
            prepared[v] = (static, params._replace(depth=costs.depth_policy(calibration, prepared["cost_model"], **fields, depth=static.depth)), run, loop)
    else:
        names = configs(drafter)
        prepared = compile_all(target, drafter, prompts[:batch], args, capacity)
    pool = _Prefills(target, prepared, prompts, args, capacity, {"plain": 1, "dflash": len(names) - 1})
    first = prefilled(target, prepared, prompts[:batch], args, capacity)  # the first prompts, one batch
    runs = {c: dict(state=state_for(first, prepared[c][0]), kind="plain" if c == "plain" else "dflash", slot=list(range(batch)),
                    next=batch, finished=0, outputs={}) for c in names}
    for c in names:  # a first run of each compiled loop, untimed (the first call of an executable is slow)
        jax.block_until_ready(prepared[c][3](prepared[c][1], state_for(first, prepared[c][0]), jnp.int32(1)))
    del first
    sums = {c: dict(seconds=0.0, cpu=0.0, tokens=0, per_batch=[], passes=0, committed=0, widths=None, steps=0, verdicts=[], compiled=0)
            for c in names}
    segment = 0
    while any(len(r["outputs"]) < len(prompts) for r in runs.values()):
        for c in names[segment % len(names):] + names[: segment % len(names)]:
            if len(runs[c]["outputs"]) < len(prompts):
                _segment(runs[c], sums[c], prepared[c], pool, batch, len(prompts))
        segment += 1
        last = {c: sums[c]["per_batch"][-1] for c in names}  # (tokens, seconds)
        print(f"{name} continuous batch {batch} segment {segment}: " + " ".join(f"{c}={t / sec:.1f}" for c, (t, sec) in last.items()), flush=True)
    for c in names:
        if c != "plain":
            sums[c]["widths"] = jax.device_get(runs[c]["state"].speculative.widths).tolist()
        plain = runs["plain"]["outputs"]
        sums[c]["verdicts"] = [compare(plain[i], o) for i, o in sorted(runs[c]["outputs"].items()) if i in plain]
    return dict(name=name, batch=batch, batches=segment, sums=sums, cost_models={capacity: prepared["cost_model"]}, continuous=True)
