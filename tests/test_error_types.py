"""Bad input to the package's building blocks is a DFlashError whose message names the argument
and what was expected (``<where>: <what> (expected <what>)``, :mod:`dflash_jax.errors`)."""

import jax.numpy as jnp
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.nn.params import KINDS, with_wide_layouts
from dflash_jax.runtime.carry import init_paged_kv_cache


def test_paged_cache_capacity_not_a_multiple_of_the_page_size():
    with pytest.raises(DFlashError) as e:
        init_paged_kv_cache(2, 1, 40, 4, 2, 8, jnp.float32, page_size=16)
    assert str(e.value) == "capacity: 40 is not a multiple of the page size 16 (expected a multiple of 16)"
    assert isinstance(e.value, ValueError)  # what callers caught before
    assert init_paged_kv_cache(2, 1, 48, 4, 2, 8, jnp.float32, page_size=16).table.shape == (1, 3)


def test_wide_layouts_of_an_unknown_kind():
    with pytest.raises(DFlashError) as e:
        with_wide_layouts({"embed": jnp.zeros((4, 2))}, kinds=("gate_up", "lm_head_t"))
    assert str(e.value) == f"kinds: got ['lm_head_t'] (expected some of {KINDS})"
