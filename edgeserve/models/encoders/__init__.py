"""Encoder models: BERT-family embedders and cross-encoder rerankers (GGUF and HF folders), sentence-transformers
modules, and decoders used as embedders or rerankers."""
