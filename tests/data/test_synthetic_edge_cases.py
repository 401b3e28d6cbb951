"""Edge cases of revtrain.data.synthetic: seeds and vocabularies that cannot work."""
import pytest

from revtrain.data import CopyTask, SyntheticSequences


@pytest.mark.parametrize("make", [CopyTask, SyntheticSequences])
def test_negative_seed_is_rejected_at_construction_not_at_the_first_batch(make):
    with pytest.raises(ValueError, match=r"seed=-1 must be >= 0"):
        make(seed=-1, process_index=0, process_count=1)


def test_vocab_beyond_int32_ids_is_rejected():
    with pytest.raises(ValueError, match=r"vocab_size=4294967296 does not fit int32"):
        SyntheticSequences(vocab_size=2**32, process_index=0, process_count=1)
    stream = SyntheticSequences(vocab_size=2**31, length=3, batch_size=2, process_index=0,
                                process_count=1).train_stream()
    inputs, _, _ = next(stream)
    assert inputs.min() >= 0
