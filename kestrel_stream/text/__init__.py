"""Text in, text out: tokenizer, chat template, sampling parameters, stop conditions, streaming detokenization."""
