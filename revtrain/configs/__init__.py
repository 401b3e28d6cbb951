"""The shipped gin configs (package data).

A package, so gin finds them by package path from anywhere: ``include
'revtrain/configs/reversible_lm.gin'``; ``revtrain-train --config_file=copy_task.gin`` finds
them by name. The repository's top-level ``configs`` is a link to this directory.
"""
