"""Test set-up: CPU, float32, a persistent compilation cache shared by all tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
