"""A step's recurrent states for the fused stack's mixer layers (layer.h's step_pools_t.recurrent, a gdn_step_t):
the engine's state pool (edgeserve/engine/cache/state_pool.py, read and written in place) and the step's ragged batch.
One struct serves every recurrent mixer block: a Gated DeltaNet reads its conv and recurrent pools, a Mamba-2 mixer
its conv and ssm pools, a gated short convolution its conv pool alone (its recurrent fields stay NULL)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from edgeserve.kernels.cpu.blocks import GdnStep


@dataclass
class RecurrentStep:
    """A plan's mixer layers (the structs its layer_t.mixer fields point to, kept alive here) and, per step, the
    states they run over (NativeDecoder.recurrent)."""

    layers: ctypes.Array
    num_layers: int  # the mixer layers: the state pool's layers
    names: tuple[str, ...] = ("conv", "recurrent")  # the pool tensors the mixers read: conv, then the recurrence's
    # Gated DeltaNet mixers (GdnLayer structs) keep a verification step's drafts off the states (StepStates.keep)
    # and advance them by the accepted ones afterwards (`replay`)
    replays: bool = False
    # the last step run with drafts kept off the states: its gdn_step_t and the tensors it points into
    drafts: tuple[GdnStep, list] | None = None

    def takes(self, states, num_rows: int) -> bool:
        """Whether the stack runs over these step states (engine.cache.state_pool.StepStates): float32 pools of this
        model's layers, each slot's block contiguous, a batch of the step's rows."""
        pool = getattr(states, "pool", None)
        if pool is None or states.batch.num_tokens != num_rows:
            return False
        tensors = [pool.tensors.get(name) for name in self.names]
        return all(t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                   and t.shape[1] == self.num_layers for t in tensors)

    def __call__(self, attn) -> tuple[GdnStep, list]:
        """The step's gdn_step_t over `attn.states`, and the tensors it points into."""
        states = attn.states
        pool, batch = states.pool, states.batch
        cu, slots = batch.cu_seqlens.to(torch.int32).contiguous(), batch.slots.to(torch.int32).contiguous()
        conv = pool.tensors[self.names[0]]
        recurrent = pool.tensors[self.names[1]] if len(self.names) > 1 else None
        rec = (None, 0, 0) if recurrent is None else (recurrent.data_ptr(), recurrent.stride(0), recurrent.stride(1))
        step = GdnStep(conv.data_ptr(), conv.stride(0), conv.stride(1), *rec, cu.data_ptr(), slots.data_ptr(),
                       slots.numel())
        keep = getattr(states, "keep", None)
        if keep is None:
            return step, [cu, slots]
        if not self.replays:
            raise ValueError("this plan's mixers cannot keep a step's drafts off their states")
        kept = [cu, slots, *self._keep_drafts(step, keep, batch.lens.tolist())]
        self.drafts = (step, kept)
        states.kept = True
        return step, kept

    def _keep_drafts(self, step: GdnStep, keep: list[int], lens: list[int]) -> list[torch.Tensor]:
        """Point `step` at each sequence's kept rows and at a buffer for its draft rows' inputs (gdn_spec_per_row
        values each: conv input and output rows, decay, beta); the tensors it points into."""
        g = self.layers[0]
        c = 2 * g.Hk * g.Dk + g.Hv * g.Dv
        per_row = 2 * c + 2 * g.Hv
        rows = max([n - k for n, k in zip(lens, keep)] + [1])
        keep_t = torch.tensor(keep, dtype=torch.int32)
        spec = torch.empty(self.num_layers, len(keep), rows, per_row, dtype=torch.float32)
        step.keep, step.spec = keep_t.data_ptr(), spec.data_ptr()
        step.spec_layer_stride, step.spec_rows = spec.stride(0), rows
        return [keep_t, spec]

    def replay(self, lib, accepted: list[int]) -> None:
        """After a step run with drafts kept off the states: advance each sequence's states (in the step's batch
        order) by its first accepted[b] drafts, from the inputs that step kept."""
        if self.drafts is None:
            raise RuntimeError("no step with drafts to replay")
        (step, kept), self.drafts = self.drafts, None
        if len(accepted) != step.B:
            raise ValueError(f"{len(accepted)} accepted counts for a step of {step.B} sequences")
        if not any(accepted):
            return
        counts = torch.tensor(accepted, dtype=torch.int32)
        for j in range(self.num_layers):
            lib.qmm_gdn_replay(ctypes.byref(self.layers[j]), ctypes.byref(step), counts.data_ptr())
