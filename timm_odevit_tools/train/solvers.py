"""Training an ODE model on many solvers (``--solvers``): a field trained on one fixed grid learns that grid, not an
ODE, and other solvers diverge on it (docs/training.md#solver-robust-training)."""
import contextlib
import random
from typing import List, Sequence, Tuple

from timm_odevit.layers import OdeDepth
from timm_odevit.layers.integrators import RK_TABLEAUS

from ..evaluate import parse_solver

__all__ = ['RandomSolvers', 'fixed_grid_solver']


def fixed_grid_solver(spec: str) -> Tuple[str, int]:
    """``'rk4:6'`` as ``('rk4', 6)`` for a fixed-grid Runge-Kutta method, or a ValueError naming the choices."""
    method, steps = parse_solver(spec)
    if method not in RK_TABLEAUS:
        raise ValueError(f'solver {spec!r}: give method:steps with a method of {list(RK_TABLEAUS)}, e.g. rk4:6.')
    return method, steps


class RandomSolvers:
    """``with sampler.drawn(trunk): loss = ...`` solves that batch with a fixed-grid solver drawn uniformly from
    ``solvers`` and gives the trunk its own back afterwards (validation and export keep the training grid). Drawn on
    the host from its own seeded generator: nothing is read from the device, and under torch.compile each solver of
    the set is one graph."""

    def __init__(self, solvers: Sequence[str], seed: int = 0) -> None:
        self.solvers: List[Tuple[str, int]] = [fixed_grid_solver(s) for s in solvers]
        if not self.solvers:
            raise ValueError('RandomSolvers needs at least one solver, e.g. euler:12,midpoint:6,rk4:3.')
        self.rng = random.Random(seed)

    def drawn(self, trunk: OdeDepth) -> 'contextlib.AbstractContextManager[OdeDepth]':
        method, steps = self.rng.choice(self.solvers)
        nfe = steps * len(RK_TABLEAUS[method][1])
        return trunk.solver(method=method, steps=steps, max_nfe=max(trunk.max_nfe, nfe))
