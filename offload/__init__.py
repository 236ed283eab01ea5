"""KV block tiers behind the device pool: host memory and disk (see DESIGN.md, "KV tiers")."""

from .config import OffloadConfig, default_disk_kv_path
from .disk_tier import DiskTier
from .host_tier import HostBlock, HostTier
from .layout import KVLayout, model_identity
from .tier_manager import OffloadStats, TierManager

__all__ = ["OffloadConfig", "default_disk_kv_path", "DiskTier", "HostBlock", "HostTier", "KVLayout",
           "model_identity", "OffloadStats", "TierManager"]
