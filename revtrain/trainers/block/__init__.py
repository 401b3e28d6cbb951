"""revtrain.trainers.block: a block trainer's step, as a plan of ops run against a store.

- `plan`: the ops of a step (`Op`, `OpKind`, `Run`), built once per trainer;
- `contract`: what each op's program takes and gives, typed both ways, and what it
  donates (`CONSUMED`);
- `bodies`: the per-device bodies a lone layer's and a scanned run's programs share;
- `finishers`: what a backward op does with its gradient (`UPDATE`, or `NORM` for
  exact global-norm clipping's first pass), a value on the op;
- `programs`: the one builder and cache of programs over runs (a lone layer is a run of
  one repetition, its body called once), a scanned run's, one ``lax.scan`` each way, in
  `scan_programs`;
- `executor`: `run_step`, the one loop that runs a plan;
- `stores`: where a step's values live (`ParamStore`, `StepValues`), with `DeviceStore`
  (`device_store`), `HostStore` (`host_store`) and stacked runs (`stacked`);
- `donation`: a program gives the buffers it consumes (by field) to its outputs;
- `turns`: keeping the layers of a scan body apart, each layer's work in its own turn;
- `precompile`: the abstract walk that finds every program of a step, compiled
  before the first step by `compiling` (largest first, side by side where safe);
- `block_trainer`: `BlockTrainer`, which `ReversibleSerialTrainer` and
  `MemoryEfficientTrainer` configure, with `BlockOptions` (`options`): how the step runs,
  as one value.
"""

from revtrain.trainers.block.block_trainer import BlockTrainer
from revtrain.trainers.block.device_store import DeviceStore
from revtrain.trainers.block.host_store import HostStore
from revtrain.trainers.block.options import BlockOptions
from revtrain.trainers.block.plan import Op, OpKind, Run, build_schedule
from revtrain.trainers.block.precompile import CompileTimes
from revtrain.trainers.block.scan_programs import find_runs
from revtrain.trainers.block.stores import HeldValues, ParamStore, StepValues, StoreFactory

__all__ = [
    "BlockOptions", "BlockTrainer", "CompileTimes", "DeviceStore", "HeldValues", "HostStore",
    "Op", "OpKind", "ParamStore", "Run", "StepValues", "StoreFactory", "build_schedule",
    "find_runs",
]
