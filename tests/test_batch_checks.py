"""Tests of revtrain/batch_checks.py."""
import pytest

from revtrain.batch_checks import check_divisible


def test_divisible_batches_pass():
    check_divisible(8, 4)
    check_divisible(3, 1)


@pytest.mark.parametrize("rows", [6, 0])
def test_an_indivisible_or_empty_batch_names_both_numbers_and_the_fix(rows):
    with pytest.raises(ValueError, match=rf"^batch size {rows} is not divisible by "
                                         r"n_devices=4; use a non-empty global batch that "
                                         r"is a multiple of 4$"):
        check_divisible(rows, 4)


def test_the_names_and_the_fix_are_the_callers():
    with pytest.raises(ValueError, match=r"^batch_size 6 is not divisible by "
                                         r"process_count=4; set it$"):
        check_divisible(6, 4, "batch_size", by="process_count", fix="set it")
    with pytest.raises(ValueError, match="n_devices=0 must be positive"):
        check_divisible(4, 0)
