"""Edge cases of revtrain.data.text: a directory as a path, negative seeds."""
import pytest

from revtrain.data import TextFiles


def test_directory_path_says_it_is_a_directory(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"is a directory"):
        TextFiles(tmp_path, process_index=0, process_count=1)


def test_negative_seed_is_rejected(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"0123456789" * 4)
    with pytest.raises(ValueError, match=r"seed=-1 must be >= 0"):
        TextFiles(path, sequence_length=4, seed=-1, eval_fraction=0.0, process_index=0,
                  process_count=1)
    inputs, targets, _ = next(TextFiles(path, sequence_length=4, batch_size=2,
                                        eval_fraction=0.0, process_index=0,
                                        process_count=1).train_stream())
    assert inputs.shape == targets.shape == (2, 4)
    assert (targets[:, :-1] == inputs[:, 1:]).all()
