"""Edge cases of revtrain.models.revnet: negative block counts, integer pixels."""
import jax
import numpy as np
import pytest

from revtrain.models import RevNet


def test_negative_block_count_is_rejected():
    with pytest.raises(ValueError, match=r"n_blocks_per_stage=\(1, -1\) must be >= 0"):
        RevNet(widths=(4, 8), n_blocks_per_stage=(1, -1))


def test_uint8_images_give_the_same_log_probs_as_float_images():
    model = RevNet(n_classes=3, widths=(4,), n_blocks_per_stage=(1,), mode="eval")
    pixels = (np.arange(48) * 7 % 256).astype(np.uint8).reshape(1, 4, 4, 3)
    model.init(pixels, rng=jax.random.key(0))
    np.testing.assert_allclose(model(pixels), model(pixels.astype(np.float32)), rtol=1e-5)
