"""Model names: the builtin catalog, local paths, the cache folder, pulling."""

from edgeserve.registry.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry
from edgeserve.registry.paths import edgeserve_home, models_dir
from edgeserve.registry.hf import is_hf_name
from edgeserve.registry.pull import cached_path, catalog_entry, is_pulled, pull, remove
from edgeserve.registry.resolve import ModelSource, list_local, resolve

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "CatalogEntry",
    "ModelSource",
    "cached_path",
    "catalog_entry",
    "edgeserve_home",
    "is_hf_name",
    "is_pulled",
    "list_local",
    "models_dir",
    "pull",
    "remove",
    "resolve",
]
