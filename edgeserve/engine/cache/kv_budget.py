"""How many bytes an engine's KV pool takes when `--kv-cache-gb` is not given, and why, in one line a user can read.

On a CPU (RAM shared with everything else on a laptop) the default pool holds DEFAULT_KV_SEATS requests at the
model's full context, and never more than `kv_cache_fraction` of the memory free: a 98 MB model with an 8k context
takes about 0.7 GB of KV, not a tenth of the machine. On a GPU the pool is what `--gpu-memory-fraction` leaves
after the weights and a warm-up step (kv_cache.gpu_pool_budget)."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
DEFAULT_KV_SEATS = 4  # requests at the full context the default CPU pool holds (shorter ones share it: many more)


@dataclass(frozen=True)
class KVBudget:
    """The KV pool's byte budget and the reason for it ("4 requests at the full 8,192-token context", ...)."""

    nbytes: int
    why: str


def default_cpu_budget(bytes_per_token: int, context: int, max_num_seqs: int, free_bytes: int,
                       fraction: float) -> KVBudget:
    """The default pool on a CPU: `DEFAULT_KV_SEATS` (at most `max_num_seqs`) requests at the full `context`, capped
    at `fraction` of `free_bytes`."""
    seats = min(DEFAULT_KV_SEATS, max_num_seqs)
    want = seats * context * bytes_per_token
    cap = int(fraction * free_bytes)
    room = f"{seats} request{'s' if seats > 1 else ''} at the full {context:,}-token context"
    share = f"{_share(fraction)} of the {free_bytes / GiB:.1f} GiB of memory free"
    if want <= cap:
        return KVBudget(want, f"room for {room} (at most {share}); --kv-cache-gb sets it")
    return KVBudget(cap, f"{share}, less than {room} ({want / GiB:.1f} GiB) would take; --kv-cache-gb sets it")


def gpu_budget_why(fraction: float) -> str:
    """Why a GPU pool has the size it has."""
    return f"what --gpu-memory-fraction {fraction:g} of the GPU leaves after the weights and a warm-up step"


def explicit_why() -> str:
    return "--kv-cache-gb"


def _share(fraction: float) -> str:
    names = {0.1: "a tenth", 0.2: "a fifth", 0.25: "a quarter", 0.5: "half"}
    return names.get(round(fraction, 6), f"{fraction:.0%}")
