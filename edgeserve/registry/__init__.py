"""Model names: the builtin catalog, local paths, the cache folder, pulling."""
