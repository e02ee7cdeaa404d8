"""The run directory: its names layout, atomic writes (atomic), the checkpoint file and its spare, the
sidecars, the ledger file, the run lock, and the inspection that commands share (inspect)."""
