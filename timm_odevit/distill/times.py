"""Where a teacher's block outputs sit on a student's depth axis.

Times are in the student trunk's units: an ODE trunk integrates over [0, t_end] (t_end = number of layers by
default); a looped or discrete trunk has its layer outputs at 1..L. A solver grid is the set of times the solver
actually visits after t = 0: the ``steps`` uniform points of a fixed-grid ODE method, or the layer numbers of a looped
or discrete trunk; adaptive ODE methods have no grid (any time in (0, t_end] is a valid target).
"""
from typing import Optional, Sequence

import torch
from torch import nn

from ..layers import ode_trunk

__all__ = [
    'TIME_RULES', 'solver_grid', 'trunk_t_end', 'uniform_times', 'paper_times', 'cls_distances', 'validate_times',
    'indices_to_times',
]

TIME_RULES = ('uniform', 'paper')


def trunk_t_end(student: nn.Module) -> float:
    """End of the student's depth interval."""
    trunk = ode_trunk(student)
    return float(trunk.t_end) if trunk is not None else float(student.trunk.num_layers)


def solver_grid(student: nn.Module) -> Optional[torch.Tensor]:
    """The times after 0 that the student's solver visits (float64), or None for an adaptive ODE method."""
    trunk = ode_trunk(student)
    if trunk is not None:
        if trunk.adaptive:
            return None
        return torch.tensor(trunk.solver_grid(trunk.t_end)[1:], dtype=torch.float64)  # the solver's own points
    return torch.arange(1, student.trunk.num_layers + 1, dtype=torch.float64)


def _check_count(num_targets: int, grid: Optional[torch.Tensor]) -> None:
    if num_targets < 1:
        raise ValueError('At least one teacher target is needed: give teacher_indices (--teacher-indices) at least '
                         'one teacher block.')
    if grid is not None and num_targets > len(grid):
        raise ValueError(
            f'{num_targets} teacher targets but the student solver visits only {len(grid)} points: two targets would '
            'share a state. Raise the student\'s ode_steps (or depth), or distil fewer teacher blocks '
            '(teacher_indices).')


def _snap(raw: torch.Tensor, grid: Optional[torch.Tensor]) -> torch.Tensor:
    """Move each time to its nearest grid point, keeping the sequence strictly increasing and inside the grid."""
    if grid is None:
        return raw
    K, S = len(raw), len(grid)
    idx = (raw[:, None] - grid[None, :]).abs().argmin(dim=1).tolist()
    # forward pass: no two targets on one point; backward pass: leave room for the targets still to come
    for k in range(1, K):
        idx[k] = max(idx[k], idx[k - 1] + 1)
    for k in range(K - 1, -1, -1):
        idx[k] = min(idx[k], S - K + k, idx[k + 1] - 1 if k + 1 < K else S - 1)
    return grid[idx]


def uniform_times(num_targets: int, t_end: float, grid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Target k (1..K) at t_end * k / K, snapped to the solver grid: the last teacher block meets the end."""
    _check_count(num_targets, grid)
    raw = torch.arange(1, num_targets + 1, dtype=torch.float64) * (t_end / num_targets)
    return _snap(raw, grid)


def cls_distances(cls_states: torch.Tensor) -> torch.Tensor:
    """Mean L2 distance between consecutive CLS states: [K + 1, B, D] (input state first) -> [K]."""
    return (cls_states[1:] - cls_states[:-1]).float().norm(dim=-1).mean(dim=1).double()


def paper_times(distances: torch.Tensor, t_end: float, grid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ODE-ViT's rule, our reading: a teacher block takes depth in proportion to how far it moves the CLS token.

    With d_k the distance block k moves the CLS state (``cls_distances``), target k sits at t_end * D_k / D_K,
    D_k = d_1 + ... + d_k, snapped to the nearest solver point and kept strictly increasing. A block that changes
    the representation a lot gets a long stretch of the trajectory (DINO's last block gets the final third of the
    grid in the paper: [3, 6, 8, ..., 24, 35] on 36 points).
    """
    distances = torch.as_tensor(distances, dtype=torch.float64).flatten()
    _check_count(len(distances), grid)
    if not bool(torch.isfinite(distances).all()) or bool((distances < 0).any()):
        raise ValueError(f'Teacher CLS distances must be finite and non-negative, got {distances.tolist()}.')
    # a block that leaves CLS unchanged still needs its own time: give it a sliver of the interval
    distances = distances.clamp_min(1e-6 * float(distances.sum()) + 1e-12)
    cumulative = distances.cumsum(0)
    return _snap(t_end * cumulative / cumulative[-1], grid)


def indices_to_times(indices: Sequence[int], student: nn.Module) -> torch.Tensor:
    """Solver grid indices (0 = the input, as the paper's [3, 6, ..., 35] on 36 points) to times."""
    grid = solver_grid(student)
    if grid is None:
        raise ValueError('An adaptive ODE method has no solver grid: give times, not grid indices.')
    full = torch.cat([grid.new_zeros(1), grid])
    bad = [i for i in indices if not (isinstance(i, int) and 1 <= i < len(full))]
    if bad:
        raise ValueError(f'Grid indices must be integers in 1..{len(full) - 1} (0 is the input), got {bad}.')
    return full[list(indices)]


def validate_times(
        times: Sequence[float],
        num_targets: int,
        t_end: float,
        grid: Optional[torch.Tensor],
) -> torch.Tensor:
    """Check a user's time list: one per target, strictly increasing, inside (0, t_end], at most one per point."""
    times = torch.as_tensor(times, dtype=torch.float64).flatten()
    if len(times) != num_targets:
        raise ValueError(f'Got {len(times)} times for {num_targets} teacher targets; give one time per target.')
    _check_count(num_targets, grid)
    if not bool(torch.isfinite(times).all()):
        raise ValueError(f'Times must be finite, got {times.tolist()}.')
    if bool((times[1:] <= times[:-1]).any()):
        raise ValueError(f'Times must be strictly increasing, got {times.tolist()}.')
    if float(times[0]) <= 0 or float(times[-1]) > t_end * (1 + 1e-9):
        raise ValueError(f'Times must lie in (0, {t_end}] (the student\'s depth interval), got {times.tolist()}.')
    return times
