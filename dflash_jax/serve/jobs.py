"""What a request asks of the engine (:class:`JobSpec`), its handle (:class:`Job`) and the events
the engine sends back on it (:class:`Text`, :class:`Done`, :class:`Failed`).

The engine thread posts events onto the request's asyncio queue through the request's event loop
(``call_soon_threadsafe``); the request's handler sets :attr:`Job.cancelled` when its client goes
away, and the engine frees the row at its next round trip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from typing import Any


from dflash_jax.decode.auto import costs
from dflash_jax.arguments import drafter_decoding
from dflash_jax.decode.logprobs import MAX_TOP_LOGPROBS
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.loading import Drafter, Target
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.auto.policy import Calibration


@dataclasses.dataclass(frozen=True, eq=False)
class ServedModel:
    """The model a server serves.

    Attributes:
      target: the loaded target (with a tokenizer).
      drafter: the DFlash drafter, or ``None`` for plain decoding.
      name: the model name clients must send (``--served-model-name``).
      n_max: the default draft depth (``--n-max``; ``None``: the drafter's recorded one, which
        may be ``"auto"``: :meth:`depth_params`).
      tree: the default tree's nodes (``--tree``; ``0``: a chain; ``None``: the drafter's
        recorded tree where its recorded depth applies; a request's own ``n_max`` drafts a chain),
        :func:`~dflash_jax.arguments.drafter_decoding`.
      chat_template_kwargs: template variables every chat request gets (a request's own
        ``chat_template_kwargs`` override them).
      aliases: other names clients may send for it (the embedded default model's file name).
    """

    target: Target
    drafter: Drafter | None = None
    name: str = "dflash-jax"
    n_max: int | str | None = None
    tree: int | None = None
    chat_template_kwargs: dict | None = None
    aliases: tuple[str, ...] = ()
    _costs: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def names(self) -> list[str]:
        """Every name the model is served under: :attr:`name` first, then :attr:`aliases`."""
        return [self.name, *(a for a in self.aliases if a != self.name)]

    @property
    def params(self) -> Params:
        return Params(self.target.state(), None if self.drafter is None else self.drafter.state())

    def depth_params(self, params: Params, static: Decoding, state, run) -> Params:
        """``params`` with the depth policy of ``n_max="auto"`` for a batch of ``state``'s rows
        (costs kept on disk for this machine, pair and batch size, else measured now with
        ``run``, the batch's own loop, on copies of ``state`` with every row running: a few seconds on this
        CPU, once per machine and size; :meth:`~dflash_jax.serve.engine.Engine.warm_up` does it
        for every size before the server listens)."""
        calibration = self.drafter.calibration or Calibration.identity(static.depth)
        key = costs.cost_key(static, params, state.tokens.shape[0], (self.target.source, self.drafter.source))
        name = json.dumps(key, sort_keys=True)  # one measurement per process and key, kept or not
        params, self._costs[name] = costs.adaptive_params(params, static, calibration, run, key, state, self._costs.get(name))
        return params

    def decoding(self, n_max: int | None = None, logprobs: bool = False) -> Decoding:
        """The static decoding set-up of a request: the server's, or a chain of the request's own
        ``n_max`` (raises DFlashError for a bad one); with ``logprobs`` one that records the
        target's log-probabilities (``MAX_TOP_LOGPROBS`` alternatives: every request that asks
        for them shares it)."""
        if self.drafter is None:
            static = Decoding(self.target.cfg)
        else:
            depth = n_max if n_max is not None else self.n_max
            static = drafter_decoding(self.target.cfg, self.drafter, "argmax", depth, self.tree if n_max is None else None)
        return dataclasses.replace(static, logprobs=MAX_TOP_LOGPROBS) if logprobs else static


MAX_STOPS = 4
"""Stop texts per request (OpenAI's limit); a row holds this many stop ids besides EOS."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One generation, checked (:mod:`dflash_jax.serve.requests`).

    Attributes:
      prompt: prompt token ids.
      max_new: new-token budget (prompt + budget fit the capacity).
      static: the :class:`~dflash_jax.decode.state.Decoding` (draft depth) it runs under: requests
        share a batch when theirs are equal (the server's, unless a request asks its own ``n_max``).
      sampling: its temperature, top-k and top-p (its row's own: any mix shares a batch).
      ignore_eos: EOS does not end it.
      stop_texts: stop texts (cut before; checked on the decoded text).
      stop_ids: single-token stop texts' ids (its row ends at them on device, as at EOS).
      seed: sampling seed (the request's, else a random one): the row's key wherever it runs.
      special_tokens: its text keeps special tokens (a harmony chat answer's markers).
      logprobs: ``None``, or the alternatives per token its answer reports with each token's
        log-probability (its ``static`` records them).
    """

    prompt: tuple[int, ...]
    max_new: int
    static: Decoding
    sampling: SamplingConfig = SamplingConfig()
    ignore_eos: bool = False
    stop_texts: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    special_tokens: bool = False
    logprobs: int | None = None


@dataclasses.dataclass
class Text:
    """New answer text (``text`` may be empty while a stop text or a partial character is held)
    from ``tokens`` new tokens; ``logprobs``: their :class:`~dflash_jax.serve.logprobs.Entry`
    when the request asked for them."""

    text: str
    tokens: int
    logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Done:
    """The request finished: ``finish_reason`` is ``stop`` or ``length`` (``cancelled`` after a
    cancel); ``speculative`` holds the row's statistics under DFlash; ``cached_tokens`` counts the
    prompt's leading tokens restored from the prefix cache."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculative: dict | None = None
    cached_tokens: int = 0


@dataclasses.dataclass
class Failed:
    """The request failed inside the engine (HTTP ``status``)."""

    message: str
    status: int = 500


_ids = itertools.count()


class Job:
    """A queued or running request: its spec, the queue its events go to, and its cancel flag."""

    def __init__(self, spec: JobSpec, loop: asyncio.AbstractEventLoop | None = None):
        self.spec = spec
        self.id = next(_ids)
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.resumed = None  # the engine's row bookkeeping of a request preempted from a paged batch

    def post(self, event: Any) -> None:
        """Hands ``event`` to the request's handler (from any thread); a closed loop cancels."""
        if self.loop is None:
            self.events.put_nowait(event)
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is gone
            self.cancelled = True
