"""The model: the GPT bound to the flat buffer, generation, HF export/import, the memory estimate."""
