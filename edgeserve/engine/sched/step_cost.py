"""What a step costs: seconds as a linear function of its tokens, of the keys they attend to and of the keys the
attention reads from the pool, fitted to the step times the scheduler measures (so it follows the kernels and the
machine as they are, not as they were)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy loads where a step is fitted or predicted, not with the engine's config (the CLI's --help)
    import numpy as np


class StepKind(Enum):
    """Steps are kept apart by what they carry, so one kind's history cannot crowd out another's."""

    DECODE = 0  # decode rows only
    MIXED = 1  # decode rows and prompt tokens
    PREFILL = 2  # prompt tokens only


# consecutive rows of one sequence that the CPU attention reads each key for once (attention.c's blocks: 8 rows
# for groups of 2 to 4 query heads per kv head); a feature's scale, so the fit absorbs other models' values
ROWS_PER_KEY_READ = 8


@dataclass(frozen=True)
class StepShape:
    """The features of a step that its cost depends on."""

    tokens: int  # rows through the model
    attended: int  # keys attended to, summed over those rows (attention arithmetic)
    # keys read from the pool, summed over blocks of ROWS_PER_KEY_READ rows: a deep decode row or a lone prompt
    # token reads all its keys for itself, a prompt chunk's rows share them, so per row it costs several times more
    read: int = 0

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(self.tokens + other.tokens, self.attended + other.attended, self.read + other.read)


def chunk_shape(start: int, n: int) -> StepShape:
    """The shape of `n` new tokens of one sequence at positions start..start+n-1 (causal: token i attends to
    i + 1 keys; a block of rows reads the keys its last row sees)."""
    full, rest, r = n // ROWS_PER_KEY_READ, n % ROWS_PER_KEY_READ, ROWS_PER_KEY_READ
    read = (full + (rest > 0)) * start + r * full * (full + 1) // 2 + (n if rest else 0)
    return StepShape(n, n * start + n * (n + 1) // 2, read)


class StepCostModel:
    """seconds = a + b * tokens + c * attended + d * read, least squares in relative error over the latest
    `window` steps of each StepKind, every coefficient >= 0 (a feature no step has is left out). `predict` is None
    until the steps seen determine the coefficients."""

    def __init__(self, window: int = 16) -> None:
        self._steps: dict[StepKind, deque[tuple[int, int, int, float]]] = {k: deque(maxlen=window) for k in StepKind}
        self._coef: np.ndarray | None = None
        self._stale = False

    def observe(self, kind: StepKind, shape: StepShape, seconds: float) -> None:
        """Record one measured step."""
        if seconds > 0:
            self._steps[kind].append((shape.tokens, shape.attended, shape.read, seconds))
            self._stale = True

    def predict(self, shape: StepShape) -> float | None:
        """Seconds a step of this shape is expected to take; None while the model is undetermined."""
        if self._stale:
            self._coef, self._stale = self._fit(), False
        if self._coef is None:
            return None
        import numpy as np

        return float(self._coef @ np.array([1.0, shape.tokens, shape.attended, shape.read]))

    def _fit(self) -> np.ndarray | None:
        import numpy as np

        rows = [s for steps in self._steps.values() for s in steps]
        if len(rows) < 3:
            return None
        data = np.array(rows, dtype=np.float64)
        t = data[:, 3]
        x = np.column_stack([np.ones(len(t)), data[:, 0], data[:, 1], data[:, 2]]) / t[:, None]  # relative error
        scale = np.abs(x).max(axis=0)
        active = [i for i in range(4) if scale[i] > 0]
        scale[scale == 0] = 1.0
        x = x / scale
        while active:  # drop the most negative coefficient until none is negative (tiny active-set NNLS)
            sol, _, rank, _ = np.linalg.lstsq(x[:, active], np.ones(len(t)), rcond=None)
            if rank < len(active):
                if 3 in active:  # the steps seen cannot tell reads from arithmetic yet: fit without reads
                    active.remove(3)
                    continue
                return None
            if sol.min() >= 0:
                coef = np.zeros(4)
                coef[active] = sol / scale[active]
                return coef
            active.pop(int(np.argmin(sol)))
        return None
