"""What people and tools see of a run: progress, MFU, plots, TensorBoard, W&B, notices, the watchdog."""
