"""KV offload: a long document's KV is computed once per machine, then found on disk by the next process.

Run it twice: the first run computes the document's prefix and writes its blocks to the disk tier when it
closes; the second (a new process) reuses them, which `cached prompt tokens` and the time to answer show.

    python examples/offload_demo.py [--disk-kv-path /tmp/edgeserve-kv-demo]
"""

import argparse
import time

from edgeserve import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--disk-kv-path", default=None, help="disk tier folder (default: kv/ under the cache folder)")
a = ap.parse_args()

llm = LLM("smollm2-135m", kv_offload="cpu,disk", disk_kv_path=a.disk_kv_path)
document = " ".join(f"Entry {i}: the lighthouse keeper logged wind, tide and {i % 7} passing ships." for i in range(60))
messages = [{"role": "system", "content": "Answer from this log.\n" + document},
            {"role": "user", "content": "What did the keeper log?"}]
start = time.perf_counter()
result = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32))[0]
print(result.text)
print(f"{len(result.prompt_token_ids)} prompt tokens, {result.num_cached_tokens} cached, "
      f"{time.perf_counter() - start:.2f}s; tiers: {llm.engine.stats().offload}")
llm.close()  # the cached prefix goes down to the disk tier for the next process
