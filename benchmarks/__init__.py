"""revtrain benchmarks: peak memory vs depth and step time, one trainer per process."""
