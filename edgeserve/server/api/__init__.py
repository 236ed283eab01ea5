"""The APIs the server speaks, one adapter each: the generation APIs (openai, ollama, anthropic, responses) parse the
body into a GenerationRequest, hand it to the pipeline (edgeserve/server/respond.py) and shape its events as the API's
reply; embeddings and rerank batch their inputs through the model's EmbeddingEngine."""
