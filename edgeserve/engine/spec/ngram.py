"""Prompt lookup: propose what followed the most recent earlier occurrence of the sequence's last n tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    """Matches the last `max_n` .. `min_n` tokens (longest first) against the prompt and the output so far."""

    max_n: int = 3
    min_n: int = 1

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier match of the sequence's tail; [] when none matches."""
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows of tokens[:-1], so a match always has at least one token after it
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
