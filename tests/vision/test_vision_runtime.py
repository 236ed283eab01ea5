"""The vision runtime's encoder runs on its own thread, nicer than the engine's (so running streams keep their
pace while an image is encoded), and its outputs are cached by image key."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from edgeserve.vision.family import PreparedImage
from edgeserve.vision.runtime import ENCODER_NICE, VisionRuntime


class RecordingFamily:
    """An encoder that notes which thread ran it and at what priority."""

    projector_type = "test"
    bidirectional_images = False

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        self.calls.append((threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)))
        return [p.pixel_values.flatten()[None].repeat(p.num_tokens, 1) for p in images]

    def settings_digest(self) -> bytes:
        return b"test"


def image(value: float) -> PreparedImage:
    return PreparedImage(torch.full((3, 2, 2), value), (), 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_the_encoder_runs_on_its_own_nicer_thread_and_its_outputs_are_cached():
    family = RecordingFamily()
    runtime = VisionRuntime(family)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    out, _ = runtime.embeddings([image(1.0), image(2.0)], [b"a", b"b"])
    assert [float(o[0, 0]) for o in out] == [1.0, 2.0]
    (tid, nice), = family.calls  # one batch: both images have one shape
    assert tid != threading.get_native_id() and nice == min(19, mine + ENCODER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the caller's own priority is untouched
    again, _ = runtime.embeddings([image(2.0)], [b"b"])
    assert torch.equal(again[0], out[1]) and len(family.calls) == 1 and runtime.hits == 1
    inline = VisionRuntime(RecordingFamily(), encoder_nice=None)
    inline.embeddings([image(3.0)], [b"c"])
    assert inline.family.calls == [(threading.get_native_id(), mine)]
