"""Tree-comparison helpers shared by the tests."""
from typing import Any

import jax
import numpy as np


def assert_trees_close(actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Asserts two pytrees have the same structure and leaf-wise close values.

    On a mismatch the message names the first differing leaf path.
    """
    actual_leaves, actual_def = jax.tree_util.tree_flatten_with_path(actual)
    expected_leaves, expected_def = jax.tree_util.tree_flatten_with_path(expected)
    assert actual_def == expected_def, f"tree structures differ:\n{actual_def}\n{expected_def}"
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves, strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
            err_msg=f"leaf {jax.tree_util.keystr(path)} differs")


def float_stats(stats: Any) -> dict[str, float]:
    """A step's stats as host floats: a scalar entry under its own name, each entry ``i``
    of a vector (``layers/gradients_l2``) as ``'name[i]'``, so two steps' stats compare
    entry by entry."""
    out = {}
    for name, value in stats.items():
        value = np.asarray(value)
        if value.ndim == 0:
            out[name] = float(value)
        else:
            out.update({f"{name}[{i}]": float(v) for i, v in enumerate(value)})
    return out
