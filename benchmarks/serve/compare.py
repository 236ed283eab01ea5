"""edgeserve vs llama.cpp's server on the same GGUF, alternating A/B rounds; ratios of medians per workload,
and a greedy correctness cross-check. See README, Benchmarking.

    python benchmarks/serve/compare.py --llama-server /path/to/llama-server            # the published figures
    python benchmarks/serve/compare.py --llama-server /path/to/llama-server --quick    # small counts
    python benchmarks/serve/compare.py                                                 # llama-cpp-python[server]
"""

from __future__ import annotations

import sys

from edgeserve.bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
