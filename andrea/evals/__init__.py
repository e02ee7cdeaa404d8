"""Read-only looks at the model: the held-out loss and sample audits, multiple-choice tasks."""
