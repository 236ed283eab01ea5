"""The tiny byte-level BPE vocabulary test GGUFs carry."""

from __future__ import annotations


def byte_vocab() -> list[str]:
    """The 256 GPT-2 byte-level symbols, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# three ChatML control tokens, the 256 byte symbols, then what the merges make
TOKENS = SPECIALS + byte_vocab() + ["he", "ll", "hell"]
MERGES = ["h e", "l l", "he ll"]
