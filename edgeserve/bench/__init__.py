"""`edgeserve bench`: drive an OpenAI-compatible server with concurrent streaming requests and measure it.

Modules, one job each: workloads (prompts and arrival schedules), client (one streamed request, timed),
stats (percentiles, tokens/s, goodput), runner (a load level: closed loop or Poisson arrivals), servers
(start / stop a server process by pid, wait for health), roofline (bytes per decoded token vs bandwidth),
report (table and JSON), plot (matplotlib, optional), compare (edgeserve vs llama.cpp's server).
"""
