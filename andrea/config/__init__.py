"""The run's configuration: the schema (dataclasses), its checks, TOML layering and the generated reference."""
