"""Write your own reversible block, check that it reconstructs its inputs, train it.

A RevNet block (Gomez et al., 2017) keeps two streams and updates each with a function of
the other, so its inputs can be recomputed from its outputs:

    y1 = x1 + F(x2)             x2 = y2 - G(y1)
    y2 = x2 + G(y1)             x1 = y1 - F(x2)

A reversible trainer therefore keeps no activations between the forward and the backward
pass: it rebuilds each block's inputs from its outputs on the way back. In revtrain, F and
G are any layers -- here your own `GatedLinear` and a feed-forward made of library layers
-- and `ReversibleHalfResidual` (``(x1, x2) -> (x1 + F(x2), x2)``) with `ReversibleSwap`
does the bookkeeping. The script

1. builds a stack of such blocks and runs it forward;
2. reverses it (``reverse``) and prints the relative error of the reconstructed inputs;
3. trains a small regression model containing the blocks with `ReversibleSerialTrainer`,
   whose backward pass rebuilds each layer's input with ``reverse_and_grad`` (the
   library's tests check it gives `Trainer`'s gradients).

Run: ``python examples/custom_reversible_block.py`` (``--tiny`` for a seconds-long run).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from revtrain import layers as tl
from revtrain.trainers import ReversibleSerialTrainer


class GatedLinear(tl.Layer):
    """Your own layer with weights: ``[..., d] -> [..., d]``, ``(x @ u) * sigmoid(x @ v)``.

    A layer defines two pure methods: ``init_weights_and_state`` (weights from the input's
    shape, no real batch needed) and ``forward_with_state``. Everything else -- `pure_fn`,
    error messages naming the layer, use inside combinators and trainers -- comes from
    `tl.Layer`.
    """

    def __init__(self, d: int):
        super().__init__(n_in=1, n_out=1)
        self._d = d

    def init_weights_and_state(self, input_signature, rng):
        d_in = input_signature.shape[-1]
        ru, rv = jax.random.split(rng)
        scale = 1.0 / np.sqrt(d_in)
        u = scale * jax.random.normal(ru, (d_in, self._d), jnp.float32)
        v = scale * jax.random.normal(rv, (d_in, self._d), jnp.float32)
        return (u, v), ()  # (weights, state): this layer keeps no state.

    def forward_with_state(self, x, weights, state, rng):
        u, v = weights
        return (x @ u) * jax.nn.sigmoid(x @ v), state


def rev_block(d: int, d_ff: int) -> list[tl.Layer]:
    """One RevNet block on the streams ``(x1, x2)``: F is a normalised `GatedLinear`, G a
    feed-forward. Each half-residual adds its function of the other stream; each swap
    brings the other stream on top."""
    f = [tl.LayerNorm(), GatedLinear(d)]
    g = [tl.LayerNorm(), tl.Dense(d_ff), tl.Gelu(), tl.Dense(d)]
    return [tl.ReversibleHalfResidual(*f), tl.ReversibleSwap(),
            tl.ReversibleHalfResidual(*g), tl.ReversibleSwap()]


def relative_error(got, want) -> float:
    """``max |got - want| / max |want|`` over the leaves of two trees (on the host, in
    numpy: no device program per leaf shape)."""
    pairs = [(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    return (max(float(np.abs(a - b).max()) for a, b in pairs)
            / max(max(float(np.abs(b).max()) for _, b in pairs), 1e-30))


def check_reversal(d: int, d_ff: int, depth: int, batch: int, length: int) -> None:
    stack = tl.ReversibleSerial(*[rev_block(d, d_ff) for _ in range(depth)])
    rng = jax.random.key(0)
    x = tuple(jax.random.normal(k, (batch, length, d)) for k in jax.random.split(rng))
    weights, state = stack.init(tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in x))

    # 1. Forward (jitted: the layers' functions are pure, weights are arguments). A
    # reversal needs the forward pass's rng and state (dropout masks and stateful layers
    # are recomputed exactly), so keep them.
    y, new_state = jax.jit(stack.pure_fn)(x, weights, state, rng)

    # 2. Reverse: the inputs from the outputs alone.
    x_rebuilt = jax.jit(stack.reverse)(y, weights, state, new_state, rng)
    error = relative_error(x_rebuilt, x)
    print(f"reconstruction error after {depth} blocks (float32): {error:.2e}")
    # Float32 gives ~1e-7 per block; errors grow with depth (see tl.reconstruction_error
    # for a whole model's, and the trainers' keep_every for bounding them).
    assert error < 1e-4, f"reconstruction error {error} is too large"


def train(d: int, d_ff: int, depth: int, batch: int, length: int, steps: int,
          learning_rate: float) -> None:
    """Regression ``y = sin(3 x) . 1`` with the blocks inside a model: the layers before
    the first reversible layer (``Dense, Dup``: the two streams) and after the last one
    (``Concatenate, Dense``, the loss) are ordinary layers; `extract_reversible_blocks`
    splits the model, and `ReversibleSerialTrainer` stores only block boundaries."""
    model = tl.Serial(tl.Dense(d), tl.Dup(),
                      tl.ReversibleSerial(*[rev_block(d, d_ff) for _ in range(depth)]),
                      tl.Concatenate(), tl.Dense(1), tl.L2Loss())
    rs = np.random.RandomState(0)
    inputs = rs.uniform(-1, 1, (batch, length, 4)).astype(np.float32)
    targets = np.sin(3 * inputs).sum(-1, keepdims=True).astype(np.float32)
    weights = np.ones_like(targets)
    data = (inputs, targets, weights)
    blocks, loss_layer = tl.extract_reversible_blocks([model])
    tl.init_reversible_blocks(blocks, loss_layer, tl.signature_of(data), jax.random.key(1))
    trainer = ReversibleSerialTrainer(
        blocks, loss_layer,
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate), n_devices=1)
    losses = []
    for step in range(steps):
        loss, _ = trainer.one_step(data, jax.random.key(step), step=step)
        losses.append(float(loss))
        if steps <= 10 or (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {losses[-1]:.4f}")
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for CI)")
    args = parser.parse_args()
    d, d_ff, depth, batch, length, steps, learning_rate = (
        (8, 16, 2, 2, 4, 5, 3e-3) if args.tiny else (64, 256, 16, 8, 32, 100, 5e-4))
    check_reversal(d, d_ff, depth, batch, length)
    train(d, d_ff, depth, batch, length, steps, learning_rate)


if __name__ == "__main__":
    main()
