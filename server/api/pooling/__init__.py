"""The pooling APIs: OpenAI's /v1/embeddings and vLLM's /pooling, /classify, /score and /rerank."""
