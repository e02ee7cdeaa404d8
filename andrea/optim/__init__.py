"""The optimizers (andrea/optim/registry.py: one table of them), their hyper-parameters per step and the lr schedules."""
