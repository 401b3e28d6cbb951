"""benchmarks/step_span.py: the files and lines of definitions one step runs through."""
from benchmarks import step_span


def test_a_nested_function_counts_once_within_its_parent(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("def outer():\n    def inner():\n        return 1\n    return inner\n\n\n"
                      "def other():\n    return 2\n")
    path = str(source)
    both = step_span.span({(path, 1), (path, 2)})
    assert list(both.values()) == [4]
    assert list(step_span.span({(path, 2)}).values()) == [2]
    assert list(step_span.span({(path, 7)}).values()) == [2]


def test_a_reversible_step_runs_through_the_executor_and_the_store():
    lines = step_span.span(step_span.called_functions("ReversibleSerialTrainer",
                                                      host_only=True))
    assert "revtrain/trainers/block/executor.py" in lines
    assert "revtrain/trainers/block/device_store.py" in lines
    assert not any(path.startswith("revtrain/layers") for path in lines)
