"""The optimizers beside the trainer's AdamW: Muon on the hidden matrices (train.optimizer = "muon")."""
