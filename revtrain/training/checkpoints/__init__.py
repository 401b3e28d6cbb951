"""revtrain.training.checkpoints: saving, retaining and restoring a run's checkpoints.

- `checkpointer`: `Checkpointer`, flat checkpoints through orbax with Paxml-style retention;
- `readable`: which checkpoint can be read (damaged ones skipped, vanished ones listed again);
- `trees`: the flat form (path strings to arrays) and its checks;
- `restore_templates`: what a checkpoint is read into, built from shapes;
- `access`: whether this user may read and change the checkpoints, checked before training;
- `retention`: keeping the retention promises of earlier runs of a directory;
- `resume`: what a loop checkpoint holds, and how a run picks one up again;
- `orbax_workarounds`: filters for orbax's leftover reports after a failed read or write.
"""

from revtrain.training.checkpoints.access import CheckpointPermissionError
from revtrain.training.checkpoints.checkpointer import (
    Checkpointer,
    CheckpointSaveError,
    CheckpointUnreadableError,
)
from revtrain.training.checkpoints.trees import (
    CheckpointMismatchError,
    flatten_tree,
    unflatten_tree,
)

__all__ = [
    "CheckpointMismatchError", "CheckpointPermissionError", "CheckpointSaveError",
    "CheckpointUnreadableError",
    "Checkpointer", "flatten_tree", "unflatten_tree",
]
