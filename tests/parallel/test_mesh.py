"""Named meshes (revtrain.parallel.mesh) and how a Placement splits values over them."""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain import layers as tl
from revtrain.layers import sequence_parallel
from revtrain.parallel import mesh as mesh_lib
from revtrain.parallel.placement import BATCH_AXIS, Placement
from revtrain.parallel.rngs import StepKeys, device_rngs
from revtrain.trainers import Trainer
from tests.hlo_groups import collective_groups

NAMES = mesh_lib.MESH_AXES


def named(shape, names=NAMES):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def test_a_named_mesh_keeps_each_device_at_its_coordinates_in_canonical_order():
    user = jax.make_mesh((2, 2), ("fsdp", "data"))
    p = Placement.resolve(mesh=user)
    assert p.mesh.axis_names == NAMES and dict(p.mesh.shape) == {"data": 2, "fsdp": 2,
                                                                  "seq": 1}
    for f in range(2):
        for d in range(2):
            assert p.mesh.devices[d, f, 0] == user.devices[f, d]
    assert p.batch_axes == ("data", "fsdp") and p.weight_axes == ("fsdp",) and p.fsdp
    assert p.device_axes == NAMES and p.device_spec == P(NAMES)
    assert p.n_devices == 4 and p.n_batch_shards == 4 and p.n_seq == 1
    assert p.weight_spec((64, 128)) == P(None, "fsdp")  # fsdp=2 shards, data replicates
    assert p.weight_spec((16,)) == P()


@pytest.mark.parametrize("names,expected", [
    (("data",), None), (("batch",), None),
    (("fsdp",), {"data": 1, "fsdp": 4, "seq": 1}),
    (("seq",), {"data": 1, "fsdp": 1, "seq": 4}),
])
def test_a_one_axis_mesh_keeps_its_old_meaning_unless_named_fsdp_or_seq(names, expected):
    p = Placement.resolve(mesh=named((4,), names), fsdp=names == ("data",))
    if expected is None:
        assert p.mesh.axis_names == (BATCH_AXIS,) and p.n_seq == 1
        assert p.weight_axes == ((BATCH_AXIS,) if names == ("data",) else ())
    else:
        assert dict(p.mesh.shape) == expected


def test_a_sequence_mesh_is_no_longer_taken_as_the_batch_axis():
    model = tl.Serial(tl.Embedding(16, 8), tl.Dense(16), tl.LogSoftmax(),
                      tl.CrossEntropyLoss())
    batch = (np.zeros((2, 8), np.int32), np.zeros((2, 8), np.int32),
             np.ones((2, 8), np.float32))
    model.init(tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch))
    trainer = Trainer(model, lambda: optax.sgd(0.1), mesh=jax.make_mesh((1, 1, 4), NAMES))
    assert trainer.mesh.axis_names == NAMES and trainer.placement.n_seq == 4
    assert trainer.placement.batch_axes == ("data", "fsdp") and not trainer.fsdp


@pytest.mark.parametrize("make,match", [
    (lambda: Placement.resolve(mesh=named((2, 2), ("data", "model"))),
     r"mesh \{'data': 2, 'model': 2\} has axis 'model'; name every axis .* 'seq'"),
    (lambda: Placement.resolve(n_devices=2, mesh=named((2, 2, 1))),
     r"n_devices=2 but mesh \{'data': 2, 'fsdp': 2, 'seq': 1\} holds 4 devices"),
    (lambda: Placement.resolve(mesh=named((4, 1, 1)), fsdp=True),
     r"fsdp=True but mesh \{'data': 4, 'fsdp': 1, 'seq': 1\} has fsdp=1"),
    (lambda: Placement(named((1, 4, 1)), fsdp=False), r"fsdp=False contradicts mesh"),
    (lambda: mesh_lib.mesh_from_shape({"data": 2, "fsdp": 4}),
     r"mesh_shape=\{'data': 2, 'fsdp': 4\} has 8 devices but the run has 4 \(1 process x "
     r"4 devices\); give axis sizes whose product is 4"),
    (lambda: mesh_lib.mesh_from_shape({"data": 2, "tensor": 2}), r"has axis 'tensor'"),
    (lambda: mesh_lib.mesh_from_shape({"data": 0}), r"axis 'data' has size 0"),
])
def test_bad_meshes_are_one_line_errors_naming_the_mesh_and_the_fix(make, match):
    with pytest.raises(ValueError, match=match) as error:
        make()
    assert "\n" not in str(error.value)


def test_mesh_from_shape_orders_devices_by_process_with_the_last_axes_fastest():
    mesh = mesh_lib.mesh_from_shape({"fsdp": 2, "data": 2})
    assert mesh.axis_names == NAMES
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]
    assert mesh_lib.mesh_from_shape({"seq": 2}, n_devices=2).devices.shape == (1, 1, 2)


@pytest.mark.parametrize("shape,batch,match", [
    ((2, 2, 1), [(6, 8)], r"batch size 6 is not divisible by data x fsdp=4; mesh "
                          r"\{'data': 2, 'fsdp': 2, 'seq': 1\} splits the batch 4 ways"),
    ((1, 2, 2), [(4, 7)], r"sequence length 7 \(batch leaf 0\) is not divisible by seq=2 of "
                          r"mesh \{'data': 1, 'fsdp': 2, 'seq': 2\}; use a length"),
    ((1, 1, 4), [(4, 8), (4,)], r"batch leaf 1 has shape \(4,\) without a length axis"),
    ((1, 1, 4), [(4, 8), (4, 4)], r"batch leaves have lengths"),
])
def test_a_batch_that_does_not_split_over_the_mesh_is_refused(shape, batch, match):
    p = Placement.resolve(mesh=named(shape))
    with pytest.raises(ValueError, match=match):
        p.split_batch(tuple(np.zeros(s, np.float32) for s in batch))


def test_split_batch_permutes_the_length_axis_and_gives_each_seq_device_a_block(
        monkeypatch):
    reverse = lambda n, length: np.arange(length)[::-1].copy()  # noqa: E731
    monkeypatch.setattr(sequence_parallel, "sequence_layout", reverse)
    p = Placement.resolve(mesh=named((1, 2, 2)))
    x = np.arange(4 * 8 * 3).reshape(4, 8, 3)
    (split,) = p.split_batch((x,))
    assert split.shape == (4, 2, 4, 3) == p.per_device_shape(x.shape)
    for b in range(2):  # Device (0, f=b, s) is row b * 2 + s.
        for s in range(2):
            np.testing.assert_array_equal(split[b * 2 + s],
                                          x[2 * b:2 * b + 2, ::-1][:, 4 * s:4 * s + 4])


def test_each_row_slice_gets_its_own_key_shared_by_its_seq_group():
    p = Placement.resolve(mesh=named((2, 1, 2)))
    table = np.asarray(StepKeys(p, None)(jax.random.key(3)))
    slices = np.asarray(jax.random.key_data(device_rngs(jax.random.key(3), 2)))
    np.testing.assert_array_equal(table, np.repeat(slices, 2, axis=0))  # (d, 0, s): row 2d+s
    seq_only = StepKeys(Placement.resolve(mesh=named((1, 1, 4))), 3)(jax.random.key(3))
    one_device = StepKeys(Placement.resolve(n_devices=1), 3)(jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(seq_only),
                                  np.repeat(np.asarray(one_device), 4, axis=0))
    assert StepKeys(p, None)(jax.random.key(3)).sharding == p.per_device


def _dense_model(batch):
    model = tl.Serial(tl.Embedding(16, 32), tl.Dense(32), tl.Dense(16), tl.LogSoftmax(),
                      tl.CrossEntropyLoss())
    model.init(tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch))
    return model


class _Compiled:
    """An observer keeping the HLO text of each dispatched program."""

    def __init__(self):
        self.text = {}

    def on_dispatch(self, label, fn, args):
        self.text[label] = fn.lower(*args).compile().as_text()


def test_weight_gathers_stay_inside_an_fsdp_group_and_gradients_sum_over_data():
    batch = (np.zeros((4, 8), np.int32), np.ones((4, 8), np.int32),
             np.ones((4, 8), np.float32))
    trainer = Trainer(_dense_model(batch), lambda: optax.sgd(0.1), mesh=named((2, 2, 1)))
    compiled = _Compiled()
    trainer.observers.append(compiled)
    trainer.one_step(batch, jax.random.key(0))
    hlo = compiled.text["train_step"]
    fsdp_groups = {(0, 1), (2, 3)}  # Devices (d, f, 0) at flat index 2 * d + f.
    gathers = collective_groups(hlo, "all-gather")
    assert gathers and all(set(g) == fsdp_groups for g in gathers)
    scatters = collective_groups(hlo, "reduce-scatter")
    assert scatters and all(set(g) == fsdp_groups for g in scatters)
    assert {(0, 2), (1, 3)} in [set(g) for g in collective_groups(hlo, "all-reduce")]
