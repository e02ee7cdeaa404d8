"""The presets: one TOML file per model size and recipe (`--preset NAME`), read by andrea/config/load.py."""
