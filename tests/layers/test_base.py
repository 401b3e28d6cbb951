"""Tests for revtrain.layers.base: the vocabulary module re-exports what it names.

Other packages import `Layer` and the stack helpers from
``revtrain.layers.base``; they are defined in the concept modules and must stay reachable
here as the same objects.
"""
import jax

from revtrain.layers import base, fn, layer, signatures, stack


def test_base_re_exports_the_objects_of_the_concept_modules():
    assert base.Layer is layer.Layer and base.EMPTY is layer.EMPTY == ()
    assert (base.Fn, base.PureLayer) == (fn.Fn, fn.PureLayer)
    assert base.LayerError is signatures.LayerError
    assert base.signature_of is signatures.signature_of
    assert base.format_signature is signatures.format_signature
    assert base.ShapeDtype is jax.ShapeDtypeStruct
    assert base.inputs_from_stack is stack.inputs_from_stack
    assert base.outputs_onto_stack is stack.outputs_onto_stack
    assert base.check_n_items is stack.check_n_items


def test_every_name_in_all_is_defined():
    assert all(hasattr(base, name) for name in base.__all__)
