"""Tests of revtrain.planning.budget: budgets as written, and the one-line refusals."""
import pytest

from revtrain.planning import parse_memory_budget


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("512MiB", 512 * 2**20), ("16GB", 16 * 10**9),
    ("1.5GiB", int(1.5 * 2**30)), ("2048B", 2048), ("3kib", 3 * 1024), (" 1TiB ", 2**40),
])
def test_budgets_in_binary_and_decimal_units(text, expected):
    assert parse_memory_budget(text) == expected


@pytest.mark.parametrize("text", ["12 GB", "-1", "0", "0GiB", "12", "GiB", "12GiBs", "nanGiB",
                                  "infGB", "1e3GiB", "", "0.1B"])
def test_malformed_budgets_get_one_line_naming_the_value_and_the_form(text):
    with pytest.raises(ValueError) as error:
        parse_memory_budget(text, "--memory_budget")
    message = str(error.value)
    assert "\n" not in message and repr(text) in message and "--memory_budget=12GiB" in message


def test_a_non_string_budget_is_refused():
    with pytest.raises(ValueError, match="is not a budget"):
        parse_memory_budget(12)
