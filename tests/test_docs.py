"""The generated gin reference (docs/gin_reference.md) matches the code."""
import inspect

from docs import make_gin_reference
from revtrain import configurables


def test_gin_reference_is_up_to_date():
    with open(make_gin_reference.OUTPUT, encoding="utf-8") as f:
        assert f.read() == make_gin_reference.reference(), (
            "docs/gin_reference.md is stale; run python docs/make_gin_reference.py")


def test_gin_reference_lists_every_configurable_and_parameter():
    text = make_gin_reference.reference()
    for module, constructors in configurables.REGISTRY:
        for fn in constructors:
            assert f"`@{module}.{fn.__name__}`" in text
            for name in inspect.signature(fn).parameters:
                assert f"| `{name}` |" in text or f"| `**{name}` |" in text, (fn, name)
