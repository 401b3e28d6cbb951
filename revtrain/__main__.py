"""``python -m revtrain``: the same as ``revtrain-train`` (``--version``, ``--help``)."""

from revtrain.cli import run_train

if __name__ == "__main__":
    run_train()
