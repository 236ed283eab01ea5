"""The part of a prefix-cache key that is not token ids: adapters, images."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixKey:
    """What besides the token ids decides the KV of a sequence's tokens, so that it enters the block hashes.

    `root` starts the hash chain (e.g. a LoRA adapter's content digest and scale: two adapters never share a block,
    even the first). `spans` are (start, stop, digest) over token positions (e.g. an image's placeholder tokens and
    the digest of its pixels and projector): every block that a span touches mixes its digest into its hash."""

    root: bytes = b""
    spans: tuple[tuple[int, int, bytes], ...] = ()

    def block_extra(self, index: int, block_size: int) -> bytes:
        """The digests that block `index` mixes into its hash (empty for a block no span touches)."""
        if not self.spans:
            return b""
        lo, hi = index * block_size, (index + 1) * block_size
        return b"".join(d for start, stop, d in self.spans if start < hi and stop > lo)


NO_KEY = PrefixKey()
