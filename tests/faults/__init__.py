"""The fault suite: SIGKILL anywhere, full disk, power loss, bad inputs and signal storms against real trainers."""
