"""Depth integrators: how a trunk turns vector-field blocks into depth.

- ``DiscreteDepth``: L distinct blocks, x <- x + f_l(x). ``LoopedDepth``: one block applied L times.
- ``OdeDepth``: dx/dt = f(x) on [0, T]. Explicit Runge-Kutta methods on a fixed grid run as a plain Python loop
  whose grid is known before the solve (no host reads, one graph under ``torch.compile``); adaptive methods, Adams
  methods and the adjoint go through torchdiffeq. A layer of an ODE trunk is a point of a uniform output grid over
  [0, T] (T = number of layers, so an Euler step of size 1 is one looped block); the solver's grid is independent
  of it (``set_solver``). ``track_acceleration`` keeps the mean squared d2x/dt2 along a solve (finite differences of
  the evaluations it made anyway): a stiffness penalty for training fields that other solvers can solve.

All three return the final state and the states after the requested layers; ``nfe`` counts the last forward's
block evaluations.
"""
import contextlib
import math
import operator
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.utils.checkpoint import checkpoint
from torchdiffeq import odeint, odeint_adjoint

__all__ = [
    'DiscreteDepth', 'LoopedDepth', 'OdeDepth', 'OdeSolverError', 'FIXED_GRID_METHODS', 'ADAPTIVE_METHODS',
    'RK_TABLEAUS', 'DISCRETISATION_OPTIONS', 'SOLVER_OPTIONS', 'ode_trunk',
]

ADAPTIVE_METHODS = ('dopri5', 'dopri8', 'bosh3', 'fehlberg2', 'adaptive_heun')
# explicit Runge-Kutta tableaus (a: stage matrix rows, b: weights), the same schemes torchdiffeq's fixed-grid
# solvers use ('rk4' is its 3/8 rule), so our loop and torchdiffeq agree step for step
RK_TABLEAUS: Dict[str, Tuple[Tuple[Tuple[float, ...], ...], Tuple[float, ...]]] = {
    'euler': ((), (1.,)),
    'midpoint': (((.5,),), (0., 1.)),
    'heun2': (((1.,),), (.5, .5)),
    'heun3': (((1 / 3,), (0., 2 / 3)), (.25, 0., .75)),
    'rk4': (((1 / 3,), (-1 / 3, 1.), (1., -1., 1.)), (.125, .375, .375, .125)),
}
# multistep methods keep torchdiffeq's implementation on the same fixed grid
FIXED_GRID_METHODS = tuple(RK_TABLEAUS) + ('explicit_adams', 'implicit_adams', 'fixed_adams')
METHODS = FIXED_GRID_METHODS + ADAPTIVE_METHODS
# OdeDepth.set_solver's options: the first four decide the solution (a weight learns them), the last two only how it
# trains (adjoint) or fails (max_nfe)
DISCRETISATION_OPTIONS = ('method', 'steps', 'rtol', 'atol')
SOLVER_OPTIONS = DISCRETISATION_OPTIONS + ('adjoint', 'max_nfe')


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
        for block in self.field_blocks():
            if hasattr(block, 'set_grad_checkpointing'):
                block.set_grad_checkpointing(enable)

    def field_blocks(self) -> List[nn.Module]:
        raise NotImplementedError

    def _apply_block(
            self, block: nn.Module, x: torch.Tensor, grid_size: Tuple[int, int], constants: Dict[str, Any],
    ) -> torch.Tensor:
        self.nfe += 1
        if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
            return checkpoint(block, x, grid_size, use_reentrant=False, **constants)
        return block(x, grid_size, **constants)


def field_constants(block: nn.Module, grid_size: Tuple[int, int], x: torch.Tensor) -> Dict[str, Any]:
    """What a field needs that does not depend on the state's values (the Gaussian kernels of a grid, for states
    shaped as ``x``), computed once per forward instead of once per evaluation; blocks without ``field_constants``
    need nothing. Under torch.fx tracing (timm's FX feature extraction) nothing either: the mixer is a leaf there
    and builds what it needs in its own forward."""
    fn = getattr(block, 'field_constants', None)
    return fn(grid_size, x.shape) if fn is not None and not is_fx_symbolic_tracing() else {}


class _ResidualDepth(_DepthBase):
    """Depth as L residual updates x <- x + f_i(x); subclasses say which block is layer i."""

    def block_at(self, i: int) -> nn.Module:
        raise NotImplementedError

    def shared_block(self) -> Optional[nn.Module]:
        """The one block every layer applies, if the layers share it (its constants are then computed once)."""
        return None

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
        shared = self.shared_block()
        shared_constants = field_constants(shared, grid_size, x) if shared is not None else {}
        for i in range(last + 1):
            block = self.block_at(i)
            constants = shared_constants if shared is not None else field_constants(block, grid_size, x)
            x = x + self._apply_block(block, x, grid_size, constants)
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

    def shared_block(self) -> Optional[nn.Module]:
        return self.block

    def field_blocks(self) -> List[nn.Module]:
        return [self.block]

    def prune(self, num_layers: int) -> None:
        self.num_loops = num_layers

    def extra_repr(self) -> str:
        return f'num_loops={self.num_loops}'


class _OdeFunc(nn.Module):
    """What torchdiffeq calls: the autonomous field, counting and guarding its evaluations."""

    def __init__(
            self, owner: 'OdeDepth', grid_size: Tuple[int, int], constants: Dict[str, Any], check_finite: bool,
    ) -> None:
        super().__init__()
        self.block = owner.block
        self.grid_size = grid_size
        self.constants = constants
        self.check_finite = check_finite
        self.adaptive = owner.adaptive
        self.max_nfe = owner.max_nfe
        self.counts = owner.nfe_counts
        self.phase = 'forward'
        self.use_checkpoint = owner.grad_checkpointing
        self.last_input: Optional[torch.Tensor] = None

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.counts[self.phase] += 1
        if self.phase == 'forward':
            self.last_input = x
        if self.adaptive and self.phase == 'forward' and self.counts['forward'] > self.max_nfe:
            raise OdeSolverError(
                f'ODE solve exceeded max_nfe={self.max_nfe} function evaluations at t={float(t):.4g}. The dynamics '
                'are too stiff for the tolerances: loosen rtol/atol, use a fixed-grid method (e.g. '
                "set_solver(method='rk4', steps=12)), or raise max_nfe.")
        if self.check_finite and not torch.isfinite(x).all():
            raise OdeSolverError(
                f'ODE state became non-finite (NaN/Inf) at t={float(t):.4g} after {self.counts[self.phase]} '
                'evaluations. Check the input for NaNs, lower the learning rate, or use a fixed-grid method.')
        if self.use_checkpoint and torch.is_grad_enabled():
            return checkpoint(self.block, x, self.grid_size, use_reentrant=False, **self.constants)
        return self.block(x, self.grid_size, **self.constants)


def _lerp(t0: float, t1: float, y0: torch.Tensor, y1: torch.Tensor, t: float) -> torch.Tensor:
    """The state at t between two solver points, by linear interpolation (torchdiffeq's fixed-grid default)."""
    return y0 + (y1 - y0) * ((t - t0) / (t1 - t0))


class OdeDepth(_DepthBase):
    """Continuous depth: dx/dt = f(x) on [0, t_end] (the module docstring says how it is solved).

    Args:
        block: the vector field (autonomous: it takes no t).
        num_layers: number of uniformly spaced output points over (0, t_end] that act as this trunk's layers
            (for forward_intermediates, features_only and distillation targets).
        t_end: end of the interval; defaults to num_layers, so Euler with step 1 is the looped trunk.
        method: one of ``FIXED_GRID_METHODS`` (uniform ``steps``) or ``ADAPTIVE_METHODS`` (rtol/atol).
        steps: number of uniform solver steps over [0, t_end] for fixed-grid methods; defaults to num_layers.
        rtol, atol: tolerances for adaptive methods (torchdiffeq's defaults are far too tight for vision).
        adjoint: backpropagate with the adjoint method (O(1) memory in depth, more evaluations).
        max_nfe: cap on function evaluations in one forward solve. Adaptive solves stop with OdeSolverError when
            they exceed it; a fixed grid whose evaluations (steps x stages) exceed it is refused when it is set.
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
        if not (math.isfinite(self.t_end) and self.t_end > 0):
            raise ValueError(f't_end must be a finite number > 0, got {t_end}.')
        # the solver grid is uniform over the interval as built; pruning shortens the interval, not the grid
        self.grid_end = self.t_end
        self.nfe_counts: Dict[str, int] = {'forward': 0, 'backward': 0}
        self.track_acceleration = False
        # the last fixed-grid solve's mean squared d2x/dt2 while track_acceleration (a graph output, never read here)
        self.acceleration: Optional[torch.Tensor] = None
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
        if method not in METHODS:
            raise ValueError(f'Unknown ODE method {method!r}. Choose a fixed-grid method {list(FIXED_GRID_METHODS)} '
                             f'or an adaptive one {list(ADAPTIVE_METHODS)}.')
        steps = _positive_int('ODE steps', getattr(self, 'steps', None) if steps is None else steps)
        max_nfe = _positive_int('max_nfe', getattr(self, 'max_nfe', None) if max_nfe is None else max_nfe)
        rtol = getattr(self, 'rtol', None) if rtol is None else rtol
        atol = getattr(self, 'atol', None) if atol is None else atol
        if not (rtol > 0 and atol > 0 and math.isfinite(rtol) and math.isfinite(atol)):
            raise ValueError(f'rtol and atol must be finite and > 0, got rtol={rtol}, atol={atol}.')
        if method in RK_TABLEAUS:
            # a fixed grid's cost is known now: refuse it now rather than after minutes of stepping
            nfe = steps * (len(RK_TABLEAUS[method][1]))
            if nfe > max_nfe:
                raise ValueError(
                    f'{steps} {method} steps take {nfe} function evaluations per solve, over max_nfe={max_nfe}. '
                    f'Use fewer steps, or raise max_nfe (set_solver(max_nfe={nfe}) or ode_max_nfe={nfe}).')
        self.method, self.steps, self.rtol, self.atol, self.max_nfe = method, steps, float(rtol), float(atol), max_nfe
        self.adjoint = bool(getattr(self, 'adjoint', False) if adjoint is None else adjoint)

    def solver_options(self) -> Dict[str, Any]:
        """How the ODE is solved now, as ``set_solver`` keyword arguments (``SOLVER_OPTIONS``)."""
        return {name: getattr(self, name) for name in SOLVER_OPTIONS}

    @contextlib.contextmanager
    def solver(self, **options: Any) -> Iterator['OdeDepth']:
        """Solve another way inside a ``with`` block (``set_solver`` options); the options before it come back
        however the block ends."""
        before = self.solver_options()
        try:
            self.set_solver(**options)
            yield self
        finally:
            self.set_solver(**before)

    @property
    def adaptive(self) -> bool:
        return self.method in ADAPTIVE_METHODS

    @property
    def nfe_backward(self) -> int:
        """Function evaluations spent by the adjoint backward pass of the last solve (0 without adjoint)."""
        return self.nfe_counts['backward']

    def field_blocks(self) -> List[nn.Module]:
        return [self.block]

    def layer_times(self) -> List[float]:
        """The times of this trunk's layers, t_1..t_L (t_0 = 0 is the input)."""
        return [self.t_end * i / self.num_layers for i in range(1, self.num_layers + 1)]

    def solver_grid(self, t_stop: float) -> List[float]:
        """The solver's points from 0 to ``t_stop``: the uniform grid of ``steps`` steps over the interval as built,
        cut at ``t_stop`` (a solve that stops early, or a pruned trunk, keeps the same points)."""
        eps = 1e-6 * self.grid_end
        h = self.grid_end / self.steps
        inner = [i * h for i in range(1, self.steps + 1) if eps < i * h < t_stop - eps]
        return [0.] + inner + [t_stop]

    def _check_times(self, times: Sequence[float]) -> List[float]:
        times = [float(t) for t in times]
        if not times:
            raise ValueError('times must be a non-empty 1-D sequence.')
        increasing = all(b > a for a, b in zip(times[:-1], times[1:]))
        if not increasing or times[0] <= 0 or times[-1] > self.t_end * (1 + 1e-6):
            raise ValueError(f'times must be strictly increasing within (0, {self.t_end}], got {times}.')
        return times

    def solve(
            self, x: torch.Tensor, grid_size: Tuple[int, int], times: Sequence[float], return_last_input: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """States at ``times`` (increasing, within (0, t_end], in one solve): a tensor [len(times), *x.shape].

        With ``return_last_input``, also the state the field was last evaluated at (what trajectory distillation
        recomputes an attention map from): returned, not captured by a hook, so a compiled solve stays one graph.
        """
        if isinstance(times, torch.Tensor):
            if times.ndim != 1:
                raise ValueError('times must be a non-empty 1-D sequence.')
            times = times.tolist()  # user-given times, typically on the host; the default path never builds them
        times = self._check_times(times)
        constants = field_constants(self.block, grid_size, x)
        if self.method in RK_TABLEAUS and not (self.adjoint and torch.is_grad_enabled()):
            states, last_input = self._solve_fixed_grid(x, grid_size, times, constants)
        else:
            states, last_input = self._solve_torchdiffeq(x, grid_size, times, constants)
        return (states, last_input) if return_last_input else states

    def _solve_fixed_grid(
            self, x: torch.Tensor, grid_size: Tuple[int, int], times: List[float], constants: Dict[str, Any],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Explicit Runge-Kutta on ``solver_grid``: states at ``times`` by linear interpolation between points, and
        the input of the last field evaluation."""
        a, b = RK_TABLEAUS[self.method]
        eps = 1e-6 * self.grid_end
        grid = self.solver_grid(times[-1])
        self.nfe = self.nfe_counts['backward'] = 0
        out: List[torch.Tensor] = []
        j = 0
        y0 = x
        k0: Optional[torch.Tensor] = None
        accel = x.new_zeros((), dtype=torch.float32)
        for t0, t1 in zip(grid[:-1], grid[1:]):
            dt = t1 - t0
            last_input = y0
            k = [self._apply_block(self.block, y0, grid_size, constants)]
            if self.track_acceleration and k0 is not None:
                # sum of h * |(f(x_n+1) - f(x_n)) / h|^2: the integral of the squared second derivative
                accel = accel + (k[0] - k0).float().pow(2).mean() / (t0 - prev_t0)
            k0, prev_t0 = k[0], t0
            for row in a:
                yi = y0
                for aij, kj in zip(row, k):
                    if aij:
                        yi = yi + kj * (dt * aij)
                last_input = yi
                k.append(self._apply_block(self.block, yi, grid_size, constants))
            y1 = y0
            for bi, ki in zip(b, k):
                if bi:
                    y1 = y1 + ki * (dt * bi)
            while j < len(times) and times[j] <= t1 + eps:
                t = times[j]
                out.append(y1 if abs(t - t1) <= eps else y0 if abs(t - t0) <= eps else _lerp(t0, t1, y0, y1, t))
                j += 1
            y0 = y1
        self.nfe_counts['forward'] = self.nfe
        if self.track_acceleration:
            self.acceleration = accel / times[-1]
        return torch.stack(out), last_input

    def _solve_torchdiffeq(
            self, x: torch.Tensor, grid_size: Tuple[int, int], times: List[float], constants: Dict[str, Any],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The library path (adaptive and Adams methods, the adjoint, and the reference for the fixed-grid loop):
        states at ``times`` and the input of the last forward field evaluation."""
        self.nfe_counts['forward'] = self.nfe_counts['backward'] = 0
        if x.is_meta:
            # meta tensors carry shapes only; torchdiffeq's checks need values
            return torch.stack([x + self.block(x, grid_size, **constants) for _ in times]), x
        if x.numel() == 0:
            # nothing to solve (an adaptive step-size controller cannot measure an empty state)
            self.nfe = 0
            return x.new_empty((len(times), *x.shape)), x
        t_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        t = torch.tensor([0.] + times, dtype=t_dtype, device=x.device)
        options = {}
        if not self.adaptive:
            grid = self.solver_grid(times[-1])
            options['grid_constructor'] = lambda func, y0, t_: self._torchdiffeq_grid(grid, t_)
        func = _OdeFunc(self, grid_size, constants, check_finite=self.adaptive)
        kwargs = dict(rtol=self.rtol, atol=self.atol, method=self.method, options=options)
        try:
            if self.adjoint and torch.is_grad_enabled():
                adjoint_params = tuple(p for p in self.block.parameters() if p.requires_grad)
                out = odeint_adjoint(func, x, t, adjoint_params=adjoint_params, **kwargs)
            else:
                out = odeint(func, x, t, **kwargs)
        except AssertionError as e:
            # torchdiffeq reports a collapsed step only through assertions; our own checks decide everything else
            raise OdeSolverError(
                f'ODE solve failed ({e}) with method={self.method!r}, rtol={self.rtol}, atol={self.atol}: the step '
                'size collapsed. Loosen the tolerances, or use a fixed-grid method such as rk4.') from e
        finally:
            self.nfe = self.nfe_counts['forward']
            func.phase = 'backward'
        return out[1:], func.last_input

    @staticmethod
    def _torchdiffeq_grid(grid: List[float], t: torch.Tensor) -> torch.Tensor:
        """Our grid for torchdiffeq, in its time tensor's dtype and direction (the adjoint integrates backwards in
        negated time, piece by piece between output times)."""
        g = torch.tensor(grid, dtype=torch.float64)
        lo, hi = float(t[0]), float(t[-1])
        sign = -1.0 if lo < 0 and hi <= 0 else 1.0
        a, b = sign * lo, sign * hi
        eps = 1e-6 * max(abs(grid[-1]), 1.)
        inner = g[(g > min(a, b) + eps) & (g < max(a, b) - eps)]
        piece = torch.cat([g.new_tensor([min(a, b)]), inner, g.new_tensor([max(a, b)])])
        if a > b:
            piece = piece.flip(0)
        piece = (sign * piece).to(t)
        piece[0], piece[-1] = t[0], t[-1]
        return piece

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
        times = [layer_times[i] for i in take]
        if stop_early:
            states = self.solve(x, grid_size, times)
            return states[-1], list(states.unbind(0))
        if take[-1] != self.num_layers - 1:
            times.append(layer_times[-1])
        states = self.solve(x, grid_size, times)
        return states[-1], list(states[:len(take)].unbind(0))

    def prune(self, num_layers: int) -> None:
        """Keep the first ``num_layers`` layers: the interval ends at the kept layer's time, on the same grid."""
        self.t_end = self.layer_times()[num_layers - 1]
        self.num_layers = num_layers

    def extra_repr(self) -> str:
        return (f'num_layers={self.num_layers}, t_end={self.t_end}, method={self.method}, steps={self.steps}, '
                f'rtol={self.rtol}, atol={self.atol}, adjoint={self.adjoint}, max_nfe={self.max_nfe}')


def _positive_int(name: str, value: Any) -> int:
    """``value`` as a positive int (numpy integers welcome), or a ValueError naming ``name``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f'{name} must be a positive integer, got {value!r}.') from None
    if value < 1:
        raise ValueError(f'{name} must be a positive integer, got {value!r}.')
    return value


def ode_trunk(model: nn.Module) -> Optional[OdeDepth]:
    """The model's ODE trunk, or None for a model of another depth setting (or not of this package): the one test
    of "is this an ODE model" (its solver options live on the trunk, ``OdeDepth.set_solver``)."""
    trunk = getattr(model, 'trunk', None)
    return trunk if isinstance(trunk, OdeDepth) else None
