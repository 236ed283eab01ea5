"""edgeserve: a local LLM server for one machine, from a laptop CPU to an H100.

`from edgeserve import LLM, SamplingParams` is the Python API; the names load on first use, so that
`import edgeserve` alone stays light.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from edgeserve.llm import LLM
    from edgeserve.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from edgeserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from edgeserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'edgeserve' has no attribute {name!r}")
