"""Text handling: incremental detokenization and stop strings."""
