"""M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each token has a (t, h, w) position and each rotary pair turns by one
of the three, so an image's tokens sit on a 2-D grid while text turns by its place in the sequence.

Text tokens have all three axes equal (1-D RoPE at that position). An image of h x w language-model tokens placed
at sequence position p takes t = p, rows p .. p + h - 1, columns p .. p + w - 1; the text after it continues at
p + max(h, w). So past the last image a token at index i sits at i + delta (the request's "rope delta", zero or
negative), and decoding needs only that one offset: the 1-D path (and the fused native stack) runs it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class MRopePositions:
    """One request's M-RoPE positions: its prompt's [3, P] table and the offset of every token after it."""

    prompt: torch.Tensor  # [3, P] int64: (t, h, w) of each prompt token
    delta: int  # position of token i >= P is i + delta on every axis

    def rows(self, start: int, n: int) -> torch.Tensor:
        """The [3, n] positions of tokens start .. start + n - 1."""
        p = self.prompt.shape[1]
        idx = torch.arange(start, start + n)
        out = (idx + self.delta).expand(3, n).clone()
        inside = idx < p
        if bool(inside.any()):
            out[:, inside] = self.prompt[:, idx[inside]]
        return out

    def is_flat(self, start: int, n: int) -> bool:
        """Whether tokens start .. start + n - 1 have equal axes (text: 1-D RoPE at `rows(...)[0]` is exact)."""
        p = self.prompt.shape[1]
        if start >= p:
            return True
        part = self.prompt[:, start: min(start + n, p)]
        return bool((part == part[0]).all())


def mrope_positions(prompt_len: int, images: Sequence[tuple[int, tuple[int, int, int]]]) -> MRopePositions:
    """The M-RoPE positions of a prompt of `prompt_len` tokens with images at (first placeholder index, (t, h, w)
    grid in language-model tokens), as transformers' Qwen3-VL `get_rope_index` places them."""
    parts: list[torch.Tensor] = []
    pos = index = 0
    for start, (t, h, w) in sorted(images, key=lambda item: item[0]):
        if start < index or start + t * h * w > prompt_len:
            raise ValueError(f"image placeholders at {start} overlap another image or run past the prompt")
        parts.append((torch.arange(start - index) + pos).expand(3, -1))
        pos += start - index
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w)
        index = start + t * h * w
    parts.append((torch.arange(prompt_len - index) + pos).expand(3, -1))
    table = torch.cat(parts, dim=1).to(torch.long)
    return MRopePositions(table, pos - index)  # the last text run: token i at i - index + pos


def mrope_axes(head_dim: int, sections: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Which axis (0 t, 1 h, 2 w) turns each of the head's head_dim // 2 rotary pairs: Qwen3-VL interleaves them
    (pair i is h when i % 3 == 1 below 3 * sections[1], w when i % 3 == 2 below 3 * sections[2], else t);
    Qwen2-VL / Qwen2.5-VL give each axis a contiguous run of `sections`."""
    half = head_dim // 2
    if interleaved:
        i = torch.arange(half)
        axes = torch.zeros(half, dtype=torch.long)
        axes[(i % 3 == 1) & (i < 3 * sections[1])] = 1
        axes[(i % 3 == 2) & (i < 3 * sections[2])] = 2
        return axes
    if sum(sections) != half:
        raise ValueError(f"M-RoPE sections {list(sections)} do not add up to {half} rotary pairs")
    return torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(list(sections)))


def mrope_cos_sin(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  axes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos/sin [T, head_dim // 2] from the 1-D tables [max_positions, head_dim // 2] for positions
    [3, T]: pair j takes its value at the position of its axis `axes[j]`."""
    pair = torch.arange(axes.shape[0], device=cos.device)
    at = positions[axes.to(positions.device)].T  # [T, pairs]: each pair's own position
    return cos[at, pair], sin[at, pair]
