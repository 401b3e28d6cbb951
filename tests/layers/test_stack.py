"""Tests for revtrain.layers.stack: the stack helpers and the arity checks."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from revtrain.layers import (
    Branch,
    Drop,
    Dup,
    Fn,
    LayerError,
    Parallel,
    Select,
    Serial,
    Swap,
    inputs_from_stack,
    outputs_onto_stack,
)
from revtrain.layers.stack import check_n_items, check_per_sublayer

# --------------------------------------------------------------------------------------
# Stack helpers.


@pytest.mark.parametrize("stack, n, expected", [
    (("a", "b", "c"), 1, "a"),
    (("a", "b", "c"), 2, ("a", "b")),
    (("a", "b", "c"), 3, ("a", "b", "c")),
    (("a", "b", "c"), 0, ()),
    (["a", "b"], 2, ("a", "b")),
])
def test_inputs_from_stack(stack, n, expected):
    assert inputs_from_stack(stack, n) == expected


def test_inputs_from_a_bare_item_stack():
    x = np.ones(3)
    assert inputs_from_stack(x, 1) is x
    assert inputs_from_stack(x, 0) == ()


@pytest.mark.parametrize("outputs, stack, n, expected", [
    ("y", ("a", "b", "c"), 1, ("y", "b", "c")),
    (("y", "z"), ("a", "b", "c"), 1, ("y", "z", "b", "c")),
    ("y", ("a", "b"), 2, "y"),
    ((), ("a", "b"), 1, "b"),
    ((), ("a", "b"), 2, ()),
    ("y", ("a", "b"), 0, ("y", "a", "b")),
    (("y", "z"), (), 0, ("y", "z")),
])
def test_outputs_onto_stack(outputs, stack, n, expected):
    assert outputs_onto_stack(outputs, stack, n) == expected


@pytest.mark.parametrize("helper", [inputs_from_stack,
                                    lambda s, n: outputs_onto_stack("y", s, n)])
def test_stack_shorter_than_n_names_both_sizes(helper):
    with pytest.raises(ValueError, match="stack has 2 items but 3 are needed"):
        helper(("a", "b"), 3)
    with pytest.raises(ValueError, match="stack has 1 items but 2 are needed"):
        helper(np.ones(2), 2)


# --------------------------------------------------------------------------------------
# check_n_items, check_per_sublayer.


@pytest.mark.parametrize("items, n, got", [
    (np.ones(2), 2, "1"), ((1, 2, 3), 2, "3"), ([], 1, "0"), ((), 1, "0"),
])
def test_check_n_items_names_layer_expected_and_got(items, n, got):
    layer = Dup()
    check_n_items(layer, (1,) * n, n)
    with pytest.raises(ValueError, match=rf"^Dup expects {n} inputs but got {got}$"):
        check_n_items(layer, items, n)


def test_check_n_items_defaults_to_n_in_and_names_what_it_counts():
    check_n_items(Swap(), (1, 2))
    with pytest.raises(ValueError, match=r"^Swap expects 2 output items but got 1; fix it$"):
        check_n_items(Swap(), 1, 2, "output items", fix="fix it")


def test_check_per_sublayer_wants_a_tuple_per_sublayer():
    layer = Serial(Dup(), Drop())
    check_per_sublayer(layer, weights=((), ()), state=[(), ()])
    with pytest.raises(ValueError, match=r"^Serial expects 2 state \(one per sublayer\) but got 3; "
                                         r"pass the tuple of its sublayers' state$"):
        check_per_sublayer(layer, weights=((), ()), state=((), (), ()))
    # A bare tree is not one item per sublayer, even for one sublayer.
    with pytest.raises(ValueError, match=r"expects 1 weights .* but got a ndarray, not a tuple"):
        check_per_sublayer(Serial(Dup()), weights=np.ones(2))


# --------------------------------------------------------------------------------------
# Property tests: random combinator trees agree with a plain-Python model of the stack.
#
# A *spec* describes a layer tree: ``("dup",)``, ``("swap",)``, ``("drop",)``, ``("none",)``,
# ``("select", indices, n_in)``, ``("fn", name)`` or ``(kind, [child specs])`` for kind in
# ``serial``, ``list`` (a plain Python list inside a combinator), ``branch``, ``parallel``.
# `build` turns a spec into revtrain layers; `run_model` runs it on a Python list (top of
# stack first) without revtrain, and `model_arity` finds how many items it needs by trying
# ever larger stacks, so the reference does not share the library's arity arithmetic.


def _add(a, b):
    return a + b


def _sub(a, b):
    return a - b


def _neg(a):
    return -a


def _fork(a):
    return a, 3 * a


def _const():
    return jnp.full((2, 3), 0.5, jnp.float32)


def _sum3(a, b, c):
    return a + 2 * b + 4 * c


# name -> (function, n_in, n_out); the same functions run in the model and in `Fn`. They
# are module-level functions, so `Fn` layers built from them have structure keys.
FUNCTIONS = {
    "add": (_add, 2, 1),
    "sub": (_sub, 2, 1),
    "neg": (_neg, 1, 1),
    "fork": (_fork, 1, 2),
    "const": (_const, 0, 1),
    "sum3": (_sum3, 3, 1),
}


class Underflow(Exception):
    """The model's stack had fewer items than an op needs."""


def build(spec):
    """Returns the revtrain layer (or None / list) for ``spec``."""
    kind = spec[0]
    if kind == "none":
        return None
    if kind in ("dup", "swap", "drop"):
        return {"dup": Dup, "swap": Swap, "drop": Drop}[kind]()
    if kind == "select":
        return Select(list(spec[1]), n_in=spec[2])
    if kind == "fn":
        f, _, n_out = FUNCTIONS[spec[1]]
        return Fn(spec[1], f, n_out=n_out)
    children = [build(c) for c in spec[1]]
    if kind == "list":
        return children
    return {"serial": Serial, "branch": Branch, "parallel": Parallel}[kind](*children)


def _take(stack, n):
    if len(stack) < n:
        raise Underflow
    return stack[:n], stack[n:]


def run_model(spec, stack, in_serial=False):
    """Runs ``spec`` on the list ``stack`` (top first); returns the new list."""
    kind = spec[0]
    if kind == "none":
        return stack if in_serial else run_model(("select", (0,), 1), stack)
    if kind in ("dup", "swap", "drop", "select"):
        indices, n_in = {"dup": ((0, 0), 1), "swap": ((1, 0), 2), "drop": ((), 1),
                         "select": spec[1:]}[kind]
        items, rest = _take(stack, n_in)
        return [items[i] for i in indices] + rest
    if kind == "fn":
        f, n_in, _ = FUNCTIONS[spec[1]]
        items, rest = _take(stack, n_in)
        out = f(*items)
        return list(out if isinstance(out, tuple) else (out,)) + rest
    if kind in ("serial", "list"):
        for child in spec[1]:
            stack = run_model(child, stack, in_serial=True)
        return stack
    if kind == "branch":  # every child reads the top of the stack; n_in is their maximum
        n_in = max((model_arity(child)[0] for child in spec[1]), default=0)
        _, rest = _take(stack, n_in)
        outputs = []
        for child in spec[1]:
            child_n_in = model_arity(child)[0]
            outputs += run_model(child, stack[:child_n_in])
        return outputs + rest
    outputs = []  # parallel
    for child in spec[1]:
        items, stack = _take(stack, model_arity(child)[0])
        outputs += run_model(child, items)
    return outputs + stack


def model_arity(spec):
    """Returns ``(n_in, n_out)``: the fewest items ``spec`` runs on, and what it leaves."""
    for n in range(40):
        try:
            return n, len(run_model(spec, list(range(n))))
        except Underflow:
            continue
    raise AssertionError(f"no arity found for {spec}")


def _select():
    indices = st.lists(st.integers(0, 3), max_size=4)
    return indices.flatmap(lambda idx: st.integers(max(idx, default=-1) + 1, 4).map(
        lambda n: ("select", tuple(idx), n)))


LEAVES = st.one_of(
    st.sampled_from([("dup",), ("swap",), ("drop",), ("none",)]),
    _select(),
    st.sampled_from(sorted(FUNCTIONS)).map(lambda name: ("fn", name)),
)


TREES = st.recursive(
    LEAVES,
    lambda children: st.tuples(st.sampled_from(["serial", "list", "branch", "parallel"]),
                               st.lists(children, max_size=3)),
    max_leaves=10)


SERIALS = st.lists(TREES, max_size=6).map(lambda children: ("serial", children))


def _inputs(n):
    rng = np.random.default_rng(n)
    return [jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) for _ in range(n)]


def _as_list(y, n_out):
    if n_out == 1:
        assert not isinstance(y, tuple), "one output must come back bare"
        return [y]
    assert isinstance(y, tuple)
    return list(y)


def _assert_lists_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)


@settings(max_examples=50, deadline=None)
@given(SERIALS)
def test_random_serial_matches_list_model(spec):
    layer = build(spec)
    n_in, n_out = model_arity(spec)
    assert (layer.n_in, layer.n_out) == (n_in, n_out)
    xs = _inputs(n_in)
    outputs = _as_list(layer(inputs_from_stack(xs, n_in)), n_out)
    assert len(outputs) == n_out
    _assert_lists_close(outputs, run_model(spec, list(xs)))


@settings(max_examples=50, deadline=None)
@given(SERIALS, st.integers(1, 3))
def test_items_below_pass_through_and_wrong_counts_fail(spec, extra):
    layer = build(spec)
    n_in, n_out = layer.n_in, layer.n_out
    stack = _inputs(n_in + extra)
    # Running on the top n_in items of a deeper stack leaves the items below untouched.
    y = layer(inputs_from_stack(stack, n_in))
    new_stack = outputs_onto_stack(y, tuple(stack), n_in)
    new_stack = list(new_stack) if isinstance(new_stack, tuple) else [new_stack]
    _assert_lists_close(new_stack, run_model(spec, list(stack)))
    assert len(new_stack) == n_out + extra
    # Feeding more (or fewer) items than n_in is an error that says expected vs got.
    with pytest.raises(LayerError, match=f"expects {n_in} inputs but got {n_in + extra}"):
        layer(tuple(stack))
    if n_in >= 2:
        with pytest.raises(LayerError, match=f"expects {n_in} inputs but got {n_in - 1}"):
            layer(tuple(stack[:n_in - 1]))


@settings(max_examples=50, deadline=None)
@given(SERIALS)
def test_equal_specs_have_equal_structure_keys(spec):
    assert build(spec).structure_key == build(spec).structure_key is not None
    assert build(spec).structure_key != build(("serial", [spec, ("dup",)])).structure_key
