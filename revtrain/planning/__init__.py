"""revtrain.planning: whether a configuration fits, on which trainer, at what batch and
speed -- answered before a run allocates anything of model size.

- `budget`: memory budgets as written (``12GiB``), checked;
- `ledger`: the abstract ledger, the bytes in use at each dispatch of a step walked on
  abstract values;
- `cost`: the step-time model (work counted on the programs' jaxprs, rates measured);
- `estimate`: one configuration's predicted peak, its split and its work;
- `plan`: the candidates that fit a budget, ranked by predicted tokens/s;
- `runs`: planning a gin-configured run (``revtrain-plan``, ``revtrain-train
  --memory_budget``) and the bindings that apply its pick.

Typical use::

    from revtrain.planning import estimate, parse_memory_budget, plan
    result = plan(model, loss, batch_signature, optimizer_fn,
                  parse_memory_budget("16GiB"))
    print(result.table())
"""

from revtrain.planning.budget import parse_memory_budget
from revtrain.planning.estimate import Estimate, estimate
from revtrain.planning.plan import Candidate, Choice, Plan, default_candidates, plan

__all__ = ["Candidate", "Choice", "Estimate", "Plan", "default_candidates", "estimate",
           "parse_memory_budget", "plan"]
