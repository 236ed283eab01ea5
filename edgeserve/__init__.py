"""edgeserve: a local LLM server for one machine, from a laptop CPU to an H100."""

__version__ = "0.1.0"
