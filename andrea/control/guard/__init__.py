"""The divergence guard: its decisions over plain data, and the rollback that carries them out."""
