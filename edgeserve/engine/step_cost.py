"""What a step costs: seconds as a linear function of its tokens and of the keys they attend to, fitted to the
step times the scheduler measures (so it follows the kernels and the machine as they are, not as they were)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np


class StepKind(Enum):
    """Steps are kept apart by what they carry, so one kind's history cannot crowd out another's."""

    DECODE = 0  # decode rows only
    MIXED = 1  # decode rows and prompt tokens
    PREFILL = 2  # prompt tokens only


@dataclass(frozen=True)
class StepShape:
    """The features of a step that its cost depends on."""

    tokens: int  # rows through the model
    attended: int  # keys attended to, summed over those rows (attention work)

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(self.tokens + other.tokens, self.attended + other.attended)


def chunk_shape(start: int, n: int) -> StepShape:
    """The shape of `n` new tokens of one sequence at positions start..start+n-1 (causal: token i attends to
    i + 1 keys)."""
    return StepShape(n, n * start + n * (n + 1) // 2)


class StepCostModel:
    """seconds = a + b * tokens + c * attended, least squares in relative error over the latest `window` steps of
    each StepKind, every coefficient >= 0. `predict` is None until the steps seen determine all three."""

    def __init__(self, window: int = 16) -> None:
        self._steps: dict[StepKind, deque[tuple[int, int, float]]] = {k: deque(maxlen=window) for k in StepKind}
        self._coef: np.ndarray | None = None
        self._stale = False

    def observe(self, kind: StepKind, shape: StepShape, seconds: float) -> None:
        """Record one measured step."""
        if seconds > 0:
            self._steps[kind].append((shape.tokens, shape.attended, seconds))
            self._stale = True

    def predict(self, shape: StepShape) -> float | None:
        """Seconds a step of this shape is expected to take; None while the model is undetermined."""
        if self._stale:
            self._coef, self._stale = self._fit(), False
        if self._coef is None:
            return None
        return float(self._coef @ np.array([1.0, shape.tokens, shape.attended]))

    def _fit(self) -> np.ndarray | None:
        rows = [s for steps in self._steps.values() for s in steps]
        if len(rows) < 3:
            return None
        data = np.array(rows, dtype=np.float64)
        t = data[:, 2]
        x = np.column_stack([np.ones(len(t)), data[:, 0], data[:, 1]]) / t[:, None]  # relative error
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        x = x / scale
        active = [0, 1, 2]
        while active:  # drop the most negative coefficient until none is negative (tiny active-set NNLS)
            sol, _, rank, _ = np.linalg.lstsq(x[:, active], np.ones(len(t)), rcond=None)
            if rank < len(active):
                return None
            if sol.min() >= 0:
                coef = np.zeros(3)
                coef[active] = sol / scale[active]
                return coef
            active.pop(int(np.argmin(sol)))
        return None
