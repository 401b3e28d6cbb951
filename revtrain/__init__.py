"""revtrain: reversible networks and memory-frugal trainers for very deep models in JAX."""

from revtrain._xla_cpu import reserve_threads as _reserve_threads

__version__ = "0.1.0"

# Before JAX creates its CPU client: threads for multi-device collectives, and a longer
# collective timeout (revtrain.parallel.cpu_collectives says why).
_reserve_threads()
