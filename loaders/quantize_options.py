"""The quantize-on-load options and their check, apart from the quantizer (which needs torch), so that a bad
`--quantize-group-size` is refused without importing torch."""

from __future__ import annotations

QUANTIZE_METHODS = ("int4",)
GROUP_SIZES = (32, 64, 128, 256)  # what both torch's CPU int4 matmul and the W4A16 kernels take
DEFAULT_GROUP_SIZE = 128


def check_quantize_options(quantize: str | None, group_size: int) -> None:
    """ValueError with a user-facing message for an unknown method or a group size the kernels cannot take."""
    if quantize is not None and quantize not in QUANTIZE_METHODS:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_METHODS)}, not {quantize!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantize group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
