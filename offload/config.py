"""OffloadConfig: which KV tiers sit behind the main pool, and their budgets."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgeserve.errors import config_error
from edgeserve.registry.paths import edgeserve_home

_MODES = ("none", "cpu", "cpu,disk")
_GIB = 1 << 30


def default_disk_kv_path() -> Path:
    """The default disk tier folder: `kv/` under the edgeserve cache folder."""
    return edgeserve_home() / "kv"


@dataclass(frozen=True)
class OffloadConfig:
    """KV offload settings (flags `--kv-offload`, `--cpu-kv-gb`, `--disk-kv-gb`, `--disk-kv-path`)."""

    kv_offload: str = field(default="none", metadata={"flag": "--kv-offload"})  # "none" | "cpu" | "cpu,disk"
    # host tier budget (swap space for preempted requests included)
    cpu_kv_gb: float = field(default=4.0, metadata={"flag": "--cpu-kv-gb"})
    # disk tier budget, all models' block files under disk_kv_path together
    disk_kv_gb: float = field(default=16.0, metadata={"flag": "--disk-kv-gb"})
    disk_kv_path: str | None = field(default=None, metadata={"flag": "--disk-kv-path"})  # None: default_disk_kv_path()

    def __post_init__(self) -> None:
        mode = self.kv_offload.replace(" ", "") if isinstance(self.kv_offload, str) else self.kv_offload
        if mode not in _MODES:
            raise config_error(OffloadConfig, "kv_offload", f"be one of {', '.join(_MODES)}", self.kv_offload)
        object.__setattr__(self, "kv_offload", mode)
        for name in ("cpu_kv_gb", "disk_kv_gb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise config_error(OffloadConfig, name, "be positive", value)

    @property
    def use_cpu(self) -> bool:
        """Whether the host tier is on."""
        return self.kv_offload != "none"

    @property
    def use_disk(self) -> bool:
        """Whether the disk tier is on."""
        return self.kv_offload == "cpu,disk"

    @property
    def cpu_kv_bytes(self) -> int:
        """Host tier budget in bytes."""
        return int(self.cpu_kv_gb * _GIB)

    @property
    def disk_kv_bytes(self) -> int:
        """Disk tier budget in bytes."""
        return int(self.disk_kv_gb * _GIB)

    @property
    def disk_path(self) -> Path:
        """The disk tier's root folder."""
        return Path(self.disk_kv_path).expanduser() if self.disk_kv_path else default_disk_kv_path()
