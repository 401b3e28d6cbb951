"""CPU memory regression: reversible training keeps activation memory flat in depth.

Measured with the CPU ledger (`revtrain.memory.track_peak`) by the memory benchmark's own
worker, each configuration in a fresh process (as the benchmark does), at tiny widths so it
runs in seconds. The activation part is the ledger's peak minus the trainer's weights and
optimizer slots on the device (for `Trainer` and `ReversibleSerialTrainer` the whole
model's). The peak is deterministic in a fresh process; the bytes live when measuring
starts are not (layer objects may still hold their initial weights), so they are not used.

`ReversibleSerialTrainer` is measured both ways: scanning its runs of equal layers (the
default: one forward and one reverse program for all blocks) and one program per layer.
"Flat" allows what each flat layer adds whatever the width -- its scalar results
(gradient and weight norms) and its key, on the order of a hundred bytes -- but not a
quarter of one layer's activations per added block: a trainer keeping any activation
per layer fails it.
"""
import jax
import pytest

from benchmarks import harness, memory_vs_depth

pytestmark = pytest.mark.slow

TINY = {"d_model": 16, "d_ff": 32, "n_heads": 2, "seq_len": 16, "batch_size": 2,
        "vocab_size": 32, "dropout": 0.1, "steps": 1, "warmup": 1, "seed": 0,
        "n_devices": 1, "compilation_cache_dir": None}


def _measure(trainer: str, depth: int, **options) -> dict:
    config = TINY | options | {"trainer": trainer, "depth": depth,
                     "compilation_cache_dir": jax.config.jax_compilation_cache_dir}
    result = harness.run_worker(memory_vs_depth.__file__, config, timeout=300)
    assert "error" not in result, result.get("error")
    assert result["method"] == "ledger"
    result["activation_bytes"] = result["peak_bytes"] - result["weights_and_slots_bytes"]
    return result


# One layer's activations: a [batch, seq_len, d_model] float32 stream item.
ONE_ACTIVATION_BYTES = TINY["batch_size"] * TINY["seq_len"] * TINY["d_model"] * 4


@pytest.fixture(scope="module", params=[True, False], ids=["scanned", "per_layer"])
def reversible(request):
    return {depth: _measure("reversible", depth, scan_layers=request.param)
            for depth in (2, 8, 32)}


def test_reversible_activation_part_is_flat_from_depth_2_to_32(reversible):
    activations = {d: r["activation_bytes"] for d, r in reversible.items()}
    assert min(activations.values()) > 0
    per_block = (max(activations.values()) - min(activations.values())) / (32 - 2)
    assert per_block < ONE_ACTIVATION_BYTES / 4, activations
    # ...while the weights and slots on the device grow with depth.
    weights = [reversible[d]["weights_and_slots_bytes"] for d in (2, 8, 32)]
    assert weights[0] < weights[1] < weights[2]
    assert reversible[32]["weights_and_slots_bytes"] == (
        reversible[32]["model_weights_and_slots_bytes"])


@pytest.fixture(scope="module")
def trainer():
    return {depth: _measure("trainer", depth) for depth in (2, 8)}


def test_trainer_activation_part_grows_with_depth(reversible, trainer):
    activations = {d: r["activation_bytes"] for d, r in trainer.items()}
    # Four times the blocks: well over twice the stored activations.
    assert activations[8] > 2 * activations[2], activations
    assert activations[8] > 2 * reversible[8]["activation_bytes"]
