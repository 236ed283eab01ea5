"""The Qwen3.5 hybrids read their whole config (edgeserve.models.qwen35_config)."""

from __future__ import annotations

from edgeserve.models.qwen35_config import qwen35_config_from_gguf as config_from_gguf  # noqa: F401
from edgeserve.models.qwen35_config import qwen35_config_from_hf as config_from_hf  # noqa: F401
