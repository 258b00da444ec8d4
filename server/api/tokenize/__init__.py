"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) and the exact prompt text <-> token ids round trip."""
