"""The command line's commands beyond `train`: a run's life (operate) and data preparation (prepare)."""
