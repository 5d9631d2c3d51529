"""The ``dflash-jax`` command line: ``generate``, ``serve``, ``train``, ``make-data`` and
``calibrate-depth`` (one module each), dispatched by :mod:`dflash_jax.cli.main`, with one shared
option set (:mod:`dflash_jax.cli.options`)."""
