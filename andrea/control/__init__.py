"""The control plane: everything that keeps one long run alive beside the GPU math (andrea/kernels/).

run/ (the process, its step loop and boundary), commit/ (checkpoints committed durably), replica/ (the copy off the
machine), parallel/ (torchrun's ranks), mixture/ (the data's bandit and pivots), guard/ (divergence and rollback),
observe/ (what people see: progress, plots, notices, the watchdog). docs/architecture.md says how they fit.
"""
