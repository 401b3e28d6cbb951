"""Tests for revtrain.trainers.block.contract: every argument type says what its programs
consume, by fields it has, in the order of the outputs that take them."""
import pytest

from revtrain.trainers.block import contract


def test_every_argument_type_names_the_fields_it_consumes():
    argument_types = {contract.ForwardArgs, contract.FboArgs, contract.ReverseArgs,
                      contract.LossArgs}
    assert set(contract.CONSUMED) == argument_types
    for kind, fields in contract.CONSUMED.items():
        assert set(fields) <= set(kind._fields), kind
    assert set(contract.STACK) == argument_types
    assert all(contract.STACK[kind] in kind._fields for kind in argument_types)


def test_stack_of_is_the_stack_an_op_reads_its_sequence_length_from():
    """A reverse op's stack is its output ``y``, every other op's its input ``x``."""
    assert contract.stack_of(contract.ReverseArgs("y", "ct", "s", "s'", "r")) == "y"
    assert contract.stack_of(contract.FboArgs("x", "s", "r", "ct")) == "x"
    assert contract.stack_of(contract.LossArgs("x", "s", "r", None)) == "x"


@pytest.mark.parametrize("args,out", [
    (contract.ReverseArgs, contract.ReverseOut), (contract.FboArgs, contract.FboOut),
    (contract.ForwardArgs, contract.ForwardOut),
])
def test_consumed_fields_come_in_the_order_of_the_outputs_that_take_them(args, out):
    """``jax.jit`` pairs donated inputs with outputs in order: ``y`` -> ``x``, ``ct_y``
    -> ``ct_x``, ``x`` -> ``y``."""
    takes = {"x": "y", "y": "x", "ct_y": "ct_x"}
    outputs = [takes[name] for name in contract.CONSUMED[args]]
    assert outputs == [name for name in out._fields if name in outputs]


def test_a_lone_reverse_op_has_the_leaves_of_a_reverse_without_copies():
    """A scanned run's copies are a field a lone layer leaves None: its arguments flatten
    to the same leaves, so its program is the per-layer one."""
    import jax
    lone = contract.ReverseArgs("y", "ct", "s", "s'", "r")
    assert lone.kept is None and jax.tree.leaves(lone) == ["y", "ct", "s", "s'", "r"]


def test_the_norm_output_moves_the_pass_on_like_the_update_outputs():
    assert contract.NormOut._fields[:2] == contract.ReverseOut._fields[:2] == ("x", "ct_x")
