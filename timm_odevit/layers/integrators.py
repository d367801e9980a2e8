"""Depth integrators: how a trunk turns vector-field blocks into depth.

- ``DiscreteDepth``: L distinct blocks, x <- x + f_l(x).
- ``LoopedDepth``: one block applied L times, x <- x + f(x).
- ``OdeDepth``: dx/dt = f(x) on [0, T] solved by torchdiffeq, with explicit method, steps and tolerances.

All three share one interface: ``forward(x, grid_size, take_indices)`` returns the final state and the states
after the requested layers, and ``nfe`` holds the number of block evaluations of the last forward. A layer of an
ODE trunk is a point of a uniform output grid over [0, T] (T = number of layers by default, so an Euler step of
size 1 is exactly one looped block); the solver's own grid (method, steps) is independent of it and can be changed
on a built model with ``set_solver``.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchdiffeq import odeint, odeint_adjoint
from torchdiffeq._impl.odeint import SOLVERS

__all__ = ['DiscreteDepth', 'LoopedDepth', 'OdeDepth', 'OdeSolverError', 'FIXED_GRID_METHODS', 'ADAPTIVE_METHODS']

ADAPTIVE_METHODS = ('dopri5', 'dopri8', 'bosh3', 'fehlberg2', 'adaptive_heun')
FIXED_GRID_METHODS = tuple(m for m in SOLVERS if m not in ADAPTIVE_METHODS and m != 'scipy_solver')


class OdeSolverError(RuntimeError):
    """An ODE solve that cannot produce a usable answer (non-finite state, step underflow, NFE cap hit)."""


class _DepthBase(nn.Module):
    num_layers: int

    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.nfe = 0

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def _apply_block(self, block: nn.Module, x: torch.Tensor, grid_size: Tuple[int, int]) -> torch.Tensor:
        self.nfe += 1
        if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
            return checkpoint(block, x, grid_size, use_reentrant=False)
        return block(x, grid_size)


class _ResidualDepth(_DepthBase):
    """Depth as L residual updates x <- x + f_i(x); subclasses say which block is layer i."""

    def block_at(self, i: int) -> nn.Module:
        raise NotImplementedError

    def forward(
            self,
            x: torch.Tensor,
            grid_size: Tuple[int, int],
            take_indices: Optional[Sequence[int]] = None,
            stop_early: bool = False,
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        self.nfe = 0
        take = set(take_indices or ())
        last = max(take) if (take and stop_early) else self.num_layers - 1
        states = []
        for i in range(last + 1):
            x = x + self._apply_block(self.block_at(i), x, grid_size)
            if i in take:
                states.append(x)
        return x, states


class DiscreteDepth(_ResidualDepth):
    """L distinct blocks, each applied once as a residual update."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def block_at(self, i: int) -> nn.Module:
        return self.blocks[i]

    def field_blocks(self) -> List[nn.Module]:
        return list(self.blocks)

    def prune(self, num_layers: int) -> None:
        self.blocks = self.blocks[:num_layers]


class LoopedDepth(_ResidualDepth):
    """One block applied ``num_loops`` times with shared weights."""

    def __init__(self, block: nn.Module, num_loops: int) -> None:
        super().__init__()
        if num_loops < 1:
            raise ValueError(f'num_loops must be >= 1, got {num_loops}.')
        self.block = block
        self.num_loops = num_loops

    @property
    def num_layers(self) -> int:
        return self.num_loops

    def block_at(self, i: int) -> nn.Module:
        return self.block

    def field_blocks(self) -> List[nn.Module]:
        return [self.block]

    def prune(self, num_layers: int) -> None:
        self.num_loops = num_layers

    def extra_repr(self) -> str:
        return f'num_loops={self.num_loops}'


class _OdeFunc(nn.Module):
    """What torchdiffeq calls: the autonomous field, counting and guarding its evaluations."""

    def __init__(self, owner: 'OdeDepth', grid_size: Tuple[int, int], check_finite: bool) -> None:
        super().__init__()
        self.block = owner.block
        self.grid_size = grid_size
        self.check_finite = check_finite
        self.max_nfe = owner.max_nfe
        self.counts = owner.nfe_counts
        self.phase = 'forward'
        self.use_checkpoint = owner.grad_checkpointing

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.counts[self.phase] += 1
        if self.phase == 'forward' and self.counts['forward'] > self.max_nfe:
            raise OdeSolverError(
                f'ODE solve exceeded max_nfe={self.max_nfe} function evaluations at t={float(t):.4g}. The dynamics '
                'are too stiff for the tolerances: loosen rtol/atol, use a fixed-grid method (e.g. '
                "set_solver(method='rk4', steps=12)), or raise max_nfe.")
        if self.check_finite and not torch.isfinite(x).all():
            raise OdeSolverError(
                f'ODE state became non-finite (NaN/Inf) at t={float(t):.4g} after {self.counts[self.phase]} '
                'evaluations. Check the input for NaNs, lower the learning rate, or use a fixed-grid method.')
        if self.use_checkpoint and torch.is_grad_enabled():
            return checkpoint(self.block, x, self.grid_size, use_reentrant=False)
        return self.block(x, self.grid_size)


class OdeDepth(_DepthBase):
    """Continuous depth: dx/dt = f(x) on [0, t_end], solved with torchdiffeq.

    Args:
        block: the vector field (autonomous: it takes no t).
        num_layers: number of uniformly spaced output points over (0, t_end] that act as this trunk's layers
            (for forward_intermediates, features_only and distillation targets).
        t_end: end of the interval; defaults to num_layers, so Euler with step 1 is the looped trunk.
        method: any torchdiffeq method; fixed-grid ones use ``steps`` uniform steps, adaptive ones rtol/atol.
        steps: number of uniform solver steps for fixed-grid methods; defaults to num_layers.
        rtol, atol: tolerances for adaptive methods (torchdiffeq's defaults are far too tight for vision).
        adjoint: backpropagate with the adjoint method (O(1) memory in depth, more evaluations).
        max_nfe: cap on function evaluations in one forward solve; exceeding it raises OdeSolverError.
    """

    def __init__(
            self,
            block: nn.Module,
            num_layers: int,
            t_end: Optional[float] = None,
            method: str = 'euler',
            steps: Optional[int] = None,
            rtol: float = 1e-3,
            atol: float = 1e-4,
            adjoint: bool = False,
            max_nfe: int = 1000,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f'num_layers must be >= 1, got {num_layers}.')
        self.block = block
        self.num_layers = num_layers
        self.t_end = float(num_layers if t_end is None else t_end)
        if not self.t_end > 0:
            raise ValueError(f't_end must be > 0, got {t_end}.')
        self.nfe_counts: Dict[str, int] = {'forward': 0, 'backward': 0}
        self.set_solver(method=method, steps=num_layers if steps is None else steps, rtol=rtol, atol=atol,
                        adjoint=adjoint, max_nfe=max_nfe)

    def set_solver(
            self,
            method: Optional[str] = None,
            steps: Optional[int] = None,
            rtol: Optional[float] = None,
            atol: Optional[float] = None,
            adjoint: Optional[bool] = None,
            max_nfe: Optional[int] = None,
    ) -> None:
        """Change how the ODE is solved (e.g. evaluate a model trained with 12 Euler steps using 6 RK4 steps)."""
        method = getattr(self, 'method', None) if method is None else method
        if method not in SOLVERS or method == 'scipy_solver':
            raise ValueError(f'Unknown ODE method {method!r}. Choose a fixed-grid method {list(FIXED_GRID_METHODS)} '
                             f'or an adaptive one {list(ADAPTIVE_METHODS)}.')
        steps = getattr(self, 'steps', None) if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f'ODE steps must be a positive integer, got {steps!r}.')
        rtol = getattr(self, 'rtol', None) if rtol is None else rtol
        atol = getattr(self, 'atol', None) if atol is None else atol
        if not (rtol > 0 and atol > 0):
            raise ValueError(f'rtol and atol must be > 0, got rtol={rtol}, atol={atol}.')
        max_nfe = getattr(self, 'max_nfe', None) if max_nfe is None else max_nfe
        if isinstance(max_nfe, bool) or not isinstance(max_nfe, int) or max_nfe < 1:
            raise ValueError(f'max_nfe must be a positive integer, got {max_nfe!r}.')
        self.method, self.steps, self.rtol, self.atol, self.max_nfe = method, steps, float(rtol), float(atol), max_nfe
        self.adjoint = bool(getattr(self, 'adjoint', False) if adjoint is None else adjoint)

    @property
    def adaptive(self) -> bool:
        return self.method in ADAPTIVE_METHODS

    @property
    def nfe_backward(self) -> int:
        """Function evaluations spent by the adjoint backward pass of the last solve (0 without adjoint)."""
        return self.nfe_counts['backward']

    def field_blocks(self) -> List[nn.Module]:
        return [self.block]

    def layer_times(self) -> torch.Tensor:
        """The times of this trunk's layers, t_1..t_L (t_0 = 0 is the input)."""
        return torch.linspace(0., self.t_end, self.num_layers + 1, dtype=torch.float64)[1:]

    def _fixed_grid(self, func: nn.Module, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The solver grid between t[0] and t[-1]: the uniform grid of ``steps`` steps over [0, t_end], cut to the
        span, so a solve that stops early (or the adjoint's backward pieces) keeps the same grid points."""
        # the adjoint integrates backwards in negated time: map to forward time, build, map back
        sign = -1.0 if float(t[0]) < 0 and float(t[-1]) <= 0 else 1.0
        a, b = sign * float(t[0]), sign * float(t[-1])
        lo, hi = min(a, b), max(a, b)
        uniform = torch.linspace(0., self.t_end, self.steps + 1, dtype=torch.float64)
        eps = 1e-6 * self.t_end
        inner = uniform[(uniform > lo + eps) & (uniform < hi - eps)]
        grid = torch.cat([uniform.new_tensor([lo]), inner, uniform.new_tensor([hi])])
        if a > b:
            grid = grid.flip(0)
        grid = (sign * grid).to(t)
        grid[0], grid[-1] = t[0], t[-1]
        return grid

    def solve(self, x: torch.Tensor, grid_size: Tuple[int, int], times: torch.Tensor) -> torch.Tensor:
        """States at ``times`` (increasing, within (0, t_end], in one solve): a tensor [len(times), *x.shape]."""
        times = torch.as_tensor(times, dtype=torch.float64)
        if times.ndim != 1 or len(times) == 0:
            raise ValueError('times must be a non-empty 1-D sequence.')
        if (times[1:] <= times[:-1]).any() or times[0] <= 0 or times[-1] > self.t_end + 1e-6:
            raise ValueError(f'times must be strictly increasing within (0, {self.t_end}], got {times.tolist()}.')
        self.nfe_counts['forward'] = self.nfe_counts['backward'] = 0
        t = torch.cat([times.new_zeros(1), times]).to(device=x.device)
        if x.is_meta:
            # meta tensors carry shapes only; torchdiffeq's checks need values
            return torch.stack([x + self.block(x, grid_size) for _ in range(len(times))])
        options = {} if self.adaptive else {'grid_constructor': self._fixed_grid}
        func = _OdeFunc(self, grid_size, check_finite=self.adaptive)
        t = t.to(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
        kwargs = dict(rtol=self.rtol, atol=self.atol, method=self.method, options=options)
        try:
            if self.adjoint and torch.is_grad_enabled():
                adjoint_params = tuple(p for p in self.block.parameters() if p.requires_grad)
                out = odeint_adjoint(func, x, t, adjoint_params=adjoint_params, **kwargs)
            else:
                out = odeint(func, x, t, **kwargs)
        except AssertionError as e:
            if 'underflow' in str(e) or 'max_num_steps' in str(e):
                raise OdeSolverError(
                    f'ODE solve failed ({e}) with method={self.method!r}, rtol={self.rtol}, atol={self.atol}: the step '
                    'size collapsed. Loosen the tolerances, or use a fixed-grid method such as rk4.') from e
            raise
        finally:
            self.nfe = self.nfe_counts['forward']
            func.phase = 'backward'
        return out[1:]

    def forward(
            self,
            x: torch.Tensor,
            grid_size: Tuple[int, int],
            take_indices: Optional[Sequence[int]] = None,
            stop_early: bool = False,
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        take = sorted(set(take_indices or ()))
        layer_times = self.layer_times()
        if not take:
            return self.solve(x, grid_size, layer_times[-1:])[-1], []
        if stop_early:
            states = self.solve(x, grid_size, layer_times[:take[-1] + 1][take])
            return states[-1], list(states.unbind(0))
        times = layer_times[take]
        if take[-1] != self.num_layers - 1:
            times = torch.cat([times, layer_times[-1:]])
        states = self.solve(x, grid_size, times)
        return states[-1], list(states[:len(take)].unbind(0))

    def prune(self, num_layers: int) -> None:
        """Keep the first ``num_layers`` layers: the interval and the fixed step size shrink with them."""
        # the new end is exactly the kept layer's time, so pruned and unpruned solves share their grid points
        self.steps = max(1, round(self.steps * num_layers / self.num_layers))
        self.t_end = float(self.layer_times()[num_layers - 1])
        self.num_layers = num_layers

    def extra_repr(self) -> str:
        return (f'num_layers={self.num_layers}, t_end={self.t_end}, method={self.method}, steps={self.steps}, '
                f'rtol={self.rtol}, atol={self.atol}, adjoint={self.adjoint}, max_nfe={self.max_nfe}')
