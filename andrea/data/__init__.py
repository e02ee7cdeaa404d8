"""Data: where arms come from (sources), and a run's tokenizer, token arrays and batches (store)."""
