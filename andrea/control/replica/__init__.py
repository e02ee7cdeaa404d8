"""The run's replica off the machine: the store and its layout, the replicator thread and its plan."""
