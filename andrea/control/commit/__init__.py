"""Committing a checkpoint: one process's asynchronous writer, the sharded and the gathered ZeRO-1 commits."""
