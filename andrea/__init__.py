"""andrea."""
