"""A step's recurrent states for the fused stack's mixer layers (layer.h's step_pools_t.recurrent, a gdn_step_t):
the engine's state pool (edgeserve/engine/cache/state_pool.py, read and written in place) and the step's ragged batch.
One struct serves every recurrent mixer block: a Gated DeltaNet reads its conv and recurrent pools, a Mamba-2 mixer
its conv and ssm pools, a gated short convolution its conv pool alone (its recurrent fields stay NULL)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

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
    # the last step run with drafts kept off the states: its gdn_step_t, the tensors it points into, its state pool
    drafts: tuple[GdnStep, list, object] | None = None
    # `replay` leaves the accepted drafts owed to the states (StatePool.owe): the sequence's next step runs them
    # in its own pass over the state, anything else that reads the slot first replays them (OwedDrafts.settle);
    # False: replayed at once (an A/B switch)
    defer: bool = True

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
        held = [cu, slots]
        if self.replays and getattr(pool, "owed", None):
            held += self._owed(step, pool.take_owed(slots.tolist()))
        keep = getattr(states, "keep", None)
        if keep is None:
            return step, held
        if not self.replays:
            raise ValueError("this plan's mixers cannot keep a step's drafts off their states")
        held += self._keep_drafts(step, keep, batch.lens.tolist())
        self.drafts = (step, held, pool)
        states.kept = True
        return step, held

    @staticmethod
    def _owed(step: GdnStep, owed: list) -> list:
        """Point `step` at the rows its sequences owe their states (OwedDrafts or None, in batch order); what it
        points into (nothing when none owes any)."""
        if not any(owed):
            return []
        where = torch.tensor([o.address if o else 0 for o in owed], dtype=torch.int64)
        strides = torch.tensor([o.layer_stride if o else 0 for o in owed], dtype=torch.int64)
        counts = torch.tensor([o.n if o else 0 for o in owed], dtype=torch.int32)
        step.owed, step.owed_layer_stride, step.owed_n = where.data_ptr(), strides.data_ptr(), counts.data_ptr()
        return [where, strides, counts, [o for o in owed if o]]

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
        order) by its first accepted[b] drafts, from the inputs that step kept: owed to its slot in the pool
        (`defer`), else now."""
        if self.drafts is None:
            raise RuntimeError("no step with drafts to replay")
        (step, held, pool), self.drafts = self.drafts, None
        if len(accepted) != step.B:
            raise ValueError(f"{len(accepted)} accepted counts for a step of {step.B} sequences")
        if not any(accepted):
            return
        if self.defer:
            spec, slots = held[-1], held[1].tolist()
            for b, n in enumerate(accepted):
                if n:
                    pool.owe(slots[b], OwedDrafts(self, lib, spec, b, n))
            return
        counts = torch.tensor(accepted, dtype=torch.int32)
        for j in range(self.num_layers):
            lib.qmm_gdn_replay(ctypes.byref(self.layers[j]), ctypes.byref(step), counts.data_ptr())


@dataclass
class OwedDrafts:
    """A sequence's accepted drafts that its states have not taken yet (StatePool.owed): the inputs its verification
    step kept (`spec` [linear layers, B, rows, gdn_spec_per_row], its batch row `b`), `n` of them from row `start`."""

    recurrent: RecurrentStep
    lib: ctypes.CDLL
    spec: torch.Tensor
    b: int
    n: int
    start: int = 0

    @property
    def address(self) -> int:
        """Where its rows of the first linear layer start."""
        return self.spec[0, self.b, self.start].data_ptr()

    @property
    def layer_stride(self) -> int:
        """Values between one linear layer's rows and the next's."""
        return self.spec.stride(0)

    def settle(self, pool, slot: int, rows: int | None = None) -> OwedDrafts | None:
        """Advance slot `slot`'s states in `pool` by these rows (the first `rows` of them) now (qmm_gdn_replay over
        a batch of this one sequence): the same states its next step's pass would leave before its own rows. The
        rows still owed, if any."""
        rows = self.n if rows is None else rows
        rec = self.recurrent
        conv, state = pool.tensors[rec.names[0]], pool.tensors[rec.names[1]]
        cu, slots = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([slot], dtype=torch.int32)
        step = GdnStep(conv.data_ptr(), conv.stride(0), conv.stride(1), state.data_ptr(), state.stride(0),
                       state.stride(1), cu.data_ptr(), slots.data_ptr(), 1)
        step.spec, step.spec_layer_stride, step.spec_rows = self.address, self.layer_stride, self.spec.shape[2]
        counts = torch.tensor([rows], dtype=torch.int32)
        for j in range(rec.num_layers):
            self.lib.qmm_gdn_replay(ctypes.byref(rec.layers[j]), ctypes.byref(step), counts.data_ptr())
        return replace(self, n=self.n - rows, start=self.start + rows) if rows < self.n else None
