"""Text handling: incremental detokenization."""
