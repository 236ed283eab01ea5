"""How a model loads: one frozen set of options that the CLI, the server, `LLM` and `load_model` pass along."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.errors import EdgeserveError, ModelLoadError
from edgeserve.loaders.quantize import DEFAULT_GROUP_SIZE, check_quantize_options

from .cpu_moe import CpuMoeLayers, parse_cpu_moe_layers

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class LoadConfig:
    """Options of one model load.

    `device`: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N"; `dtype`: auto (decided by
    `models.dtype_policy.choose_dtype` from the device and the file's stored matrix type), float32, bfloat16,
    float16. `load_format="dummy"`: random weights of the shape a config.json (a file or a folder's) describes
    (4-bit with `quantize="int4"` or a 4-bit quantization_config).
    `quantize="int4"`: a float model's layer matrices are quantized to group-wise INT4 as they load (groups of
    `quantize_group_size` input columns), after activation-aware scaling from the text file
    `quantize_calibration` when one is given; a model that is already quantized loads as stored, with a warning.
    `dense_prefill` (auto / on / off): see `models.load.want_dense_prefill`; it only matters for 4-bit weights on a
    CPU. `cpu_moe_layers` (None, a count, or "all"): the routed experts of that many MoE layers (the first ones)
    stay in host memory on the native CPU kernels while the rest of the model is on `device`
    (edgeserve.models.cpu_moe); a no-op on a CPU.
    """

    dtype: str = "auto"
    device: str = "cpu"
    load_format: str = "auto"
    quantize: str | None = None
    quantize_group_size: int = DEFAULT_GROUP_SIZE
    quantize_calibration: str | None = None
    dense_prefill: str = "auto"
    cpu_moe_layers: CpuMoeLayers = None

    def check(self) -> None:
        """Raise EdgeserveError (one line) for an option no model can load with."""
        try:
            check_quantize_options(self.quantize, self.quantize_group_size)
            parse_cpu_moe_layers(self.cpu_moe_layers)
        except ValueError as e:
            raise EdgeserveError(str(e)) from None
        if self.load_format not in LOAD_FORMATS:
            raise ModelLoadError(f"load format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
