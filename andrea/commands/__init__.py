"""The command line's commands, one module per concern; andrea/cli.py parses and dispatches to them."""
