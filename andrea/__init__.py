"""A GPT trainer for one very long single-GPU run: its GPU math (kernels/) beside its asyncio control plane (control/)."""
