"""Shared settings for the benchmark tests: tiny sizes and a shared compilation cache."""
import jax
import pytest

# Tiny sizes: the tests check that the scripts run end to end, not what they measure.
TINY = ["--quick", "--d_model", "16", "--d_ff", "32", "--n_heads", "2", "--seq_len", "16",
        "--batch_size", "2", "--vocab_size", "32"]


def cache_args() -> list[str]:
    """``--compilation_cache_dir`` of the suite's compilation cache, or nothing: a worker
    then loads the programs an earlier one compiled (a tiny worker's 17 s are about 8 s
    warm), where it would compile them all, its cache off."""
    cache = jax.config.jax_compilation_cache_dir
    return ["--compilation_cache_dir", cache] if cache else []


@pytest.fixture
def quick_args(tmp_path):
    """Flags for one tiny run into ``tmp_path``; workers reuse the suite's compilation cache."""
    return TINY + ["--depths", "2", "--jobs", "2", "--steps", "1", "--warmup", "1",
                   "--out_dir", str(tmp_path)] + cache_args()
