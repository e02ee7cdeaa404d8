"""Data parallelism: the torchrun world, ZeRO-1, what ranks agree on, whether they share a run directory."""
