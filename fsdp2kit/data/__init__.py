"""Data: the built-in corpus and tokenizer, local files and HF datasets, tokenisation, packing, global order."""
