"""revtrain: reversible networks and memory-frugal trainers for very deep models in JAX."""

__version__ = "0.1.0"
