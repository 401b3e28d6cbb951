"""Tests for revtrain.parallel.rngs."""

import jax
import numpy as np

from revtrain.parallel import rngs


def test_per_device_rngs_one_device_is_a_plain_split():
    rng = jax.random.key(3)
    keys = rngs.per_device_rngs(rng, 1, 5)
    np.testing.assert_array_equal(keys[0], jax.random.key_data(jax.random.split(rng, 5)))


def test_per_device_rngs_split_by_device_then_layer():
    rng = jax.random.key(3)
    keys = rngs.per_device_rngs(rng, 4, 3)
    assert keys.shape[:2] == (4, 3)
    by_device = jax.random.split(rng, 4)
    for d in range(4):
        np.testing.assert_array_equal(
            keys[d], jax.random.key_data(jax.random.split(by_device[d], 3)))


def test_per_device_rngs_of_one_process_are_its_rows_of_the_global_split():
    rng = jax.random.key(5)
    global_keys = rngs.per_device_rngs(rng, 4, 3)
    for process_index in range(2):
        local = rngs.per_device_rngs(rng, 2, 3, process_index=process_index,
                                        process_count=2)
        np.testing.assert_array_equal(local, global_keys[2 * process_index:
                                                         2 * process_index + 2])
