"""The ``dflash-jax`` command line: ``generate``, ``serve`` and ``train``, with one shared option set."""
