"""Text handling shared by the router and the engine: tokenizer, chat template,
incremental detokenizer, stop strings. Torch-free."""
