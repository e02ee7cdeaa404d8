"""The control plane: decisions over plain data (bandit, checkpoint cadence) and the thin I/O that carries them out."""
