"""revtrain.planning: whether a configuration fits, on which trainer, at what batch and
speed -- answered before a run allocates anything of model size.

- `budget`: memory budgets as written (``12GiB``), checked;
- `ledger`: the abstract ledger, the bytes in use at each dispatch of a step walked on
  abstract values;
- `cost`: the step-time model (work counted on the programs' jaxprs, rates measured);
- `estimate`: one configuration's predicted peak, its split and its work.
"""

from revtrain.planning.budget import parse_memory_budget
from revtrain.planning.estimate import Estimate, estimate

__all__ = ["Estimate", "estimate", "parse_memory_budget"]
