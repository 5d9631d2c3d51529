"""``dflash-jax serve``: an OpenAI-compatible server with continuous batching and DFlash.

Modules, one job each: :mod:`~dflash_jax.serve.schemas` (request and response models),
:mod:`~dflash_jax.serve.requests` (a request to a checked job), :mod:`~dflash_jax.serve.jobs`
(the job, its events, the served model), :mod:`~dflash_jax.serve.batch` (the device rows),
:mod:`~dflash_jax.serve.engine` (the thread that batches), :mod:`~dflash_jax.serve.reasoning`,
:mod:`~dflash_jax.serve.tool_calls` and :mod:`~dflash_jax.serve.harmony` (pure streaming text parsers),
:mod:`~dflash_jax.serve.responses` (events to OpenAI responses and server-sent events),
:mod:`~dflash_jax.serve.errors` (OpenAI error objects), :mod:`~dflash_jax.serve.metrics`
(Prometheus), :mod:`~dflash_jax.serve.app` (the FastAPI app) and :mod:`~dflash_jax.cli.serve`.
"""
