"""KV block tiers behind the device pool: host memory and disk (see DESIGN.md, "KV tiers").

The names below load on first use, so that `edgeserve.offload.config` (which the engine's config and the CLI
read) does not import torch.
"""

from typing import TYPE_CHECKING

__all__ = ["OffloadConfig", "default_disk_kv_path", "DiskTier", "HostBlock", "HostTier", "KVLayout",
           "model_identity", "OffloadStats", "TierManager"]

_HOMES = {"OffloadConfig": "config", "default_disk_kv_path": "config", "DiskTier": "disk_tier",
          "HostBlock": "host_tier", "HostTier": "host_tier", "KVLayout": "layout", "model_identity": "layout",
          "OffloadStats": "tier_manager", "TierManager": "tier_manager"}

if TYPE_CHECKING:
    from .config import OffloadConfig, default_disk_kv_path
    from .disk_tier import DiskTier
    from .host_tier import HostBlock, HostTier
    from .layout import KVLayout, model_identity
    from .tier_manager import OffloadStats, TierManager


def __getattr__(name: str):
    """Import the submodule that holds `name` and return it."""
    import importlib

    if name not in _HOMES:
        raise AttributeError(f"module 'edgeserve.offload' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
