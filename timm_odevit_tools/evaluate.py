"""The one evaluation loop: top-1, cross-entropy and field evaluations (NFE) of any model on any device.

``evaluate(model, data)`` takes a DataLoader (any iterable of ``(images, labels)`` batches) or a pair of tensors
``(images, labels)`` that it cuts into batches itself. It runs under ``torch.inference_mode`` with the model in eval
mode, optionally under autocast (``amp_dtype=torch.bfloat16`` on CPU or CUDA), and in a distributed run sums the
counts over ranks. ``nfe`` is the mean over forwards of ``model.nfe`` (block or field evaluations per forward, which
every timm_odevit model reports); ``None`` for a model without it, such as timm's own ViTs.

``evaluate_solved(model, data, solver)`` measures an ODE model at the solver it was built with and, when ``solver``
solves it another way (such as the grid it was trained on), once more that way; the Hub cards and the guidance
study both report these two figures.
"""
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
import torch.distributed as dist
from timm.utils import unwrap_model
from torch import nn

from timm_odevit.layers import ADAPTIVE_METHODS, ode_trunk

__all__ = ['ADAPTIVE_TOLERANCES', 'evaluate', 'evaluate_solved', 'parse_solver', 'solver_kwargs', 'solver_of']

Batches = Union[Iterable[Tuple[torch.Tensor, torch.Tensor]], Tuple[torch.Tensor, torch.Tensor]]


def parse_solver(text: str) -> Tuple[str, int]:
    """'rk4:6' -> ('rk4', 6): how an ODE model is solved for an evaluation (``model.set_solver(method, steps)``); an
    adaptive method alone ('dopri5') -> ('dopri5', 0), solved at ``ADAPTIVE_TOLERANCES`` (``solver_kwargs``)."""
    method, sep, steps = text.partition(':')
    if not sep and method in ADAPTIVE_METHODS:
        return method, 0
    if not sep or not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"A solver is 'method:steps' with steps >= 1 (e.g. 'euler:12', 'rk4:3'), or an adaptive "
                         f"method alone ({', '.join(ADAPTIVE_METHODS)}), got {text!r}.")
    return method, int(steps)


# how an adaptive solver is evaluated: tolerances (torchdiffeq's defaults are far too tight for vision) and a cap
# of evaluations per solve, past which a field is too stiff to be worth solving adaptively (OdeSolverError)
ADAPTIVE_TOLERANCES = {'rtol': 1e-3, 'atol': 1e-4, 'max_nfe': 256}


def solver_kwargs(method: str, steps: int) -> Dict[str, Any]:
    """``set_solver`` keyword arguments for a parsed solver: a fixed grid's steps, an adaptive one's tolerances, cap."""
    return dict(method=method, **(ADAPTIVE_TOLERANCES if method in ADAPTIVE_METHODS else {'steps': steps}))


def _batches(data: Batches, batch_size: int) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        x, y = data
        if len(x) != len(y):
            raise ValueError(f'{len(x)} images but {len(y)} labels.')
        return ((x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size))
    return data


def evaluate(
        model: nn.Module,
        data: Batches,
        device: Optional[Union[str, torch.device]] = None,
        amp_dtype: Optional[torch.dtype] = None,
        batch_size: int = 250,
        distributed: bool = False,
) -> Dict[str, Any]:
    """Top-1 (percent), mean cross-entropy and mean NFE per forward of ``model`` over ``data``.

    Args:
        model: Any classifier (a DDP or torch.compile wrapper included); left in eval mode.
        data: A DataLoader / iterable of ``(images, labels)`` batches, or a pair of tensors ``(images, labels)``.
        device: Where to run (default: where the model's parameters are). Batches are moved there one at a time.
        amp_dtype: Run the forward under autocast with this dtype (e.g. ``torch.bfloat16``); None for full precision.
        batch_size: Batch size when ``data`` is a pair of tensors.
        distributed: Sum the counts over the ranks of the initialised process group.

    Returns:
        ``{'top1', 'correct', 'n', 'loss', 'nfe'}``; ``nfe`` is None for models that do not count evaluations.
    """
    if device is None:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device('cpu')
    device = torch.device(device)
    owner = unwrap_model(model)  # DDP keeps the model in .module, torch.compile in ._orig_mod
    owner = owner if hasattr(owner, 'nfe') else None
    model.eval()
    # loss sum, correct, count, nfe sum, forwards: one tensor, so a distributed run reduces once
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    with torch.inference_mode():
        for x, y in _batches(data, batch_size):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                logits = model(x)
            sums[0] += nn.functional.cross_entropy(logits.float(), y, reduction='sum').double()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += len(y)
            if owner is not None:
                sums[3] += owner.nfe
                sums[4] += 1
    if distributed and dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    loss, correct, n, nfe, forwards = sums.tolist()
    if n == 0:
        raise ValueError('evaluate() got no images: the data is empty.')
    return {
        'top1': 100. * correct / n,
        'correct': int(correct),
        'n': int(n),
        'loss': loss / n,
        'nfe': nfe / forwards if forwards else None,
    }


def solver_of(model: nn.Module) -> str:
    """How a model is solved now: 'euler:12' for an ODE trunk, 'discrete' for any other model."""
    trunk = ode_trunk(model)
    return f'{trunk.method}:{trunk.steps}' if trunk is not None else 'discrete'


def evaluate_solved(
        model: nn.Module,
        data: Batches,
        solver: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
) -> Dict[str, Dict[str, Any]]:
    """``evaluate`` (``kwargs`` go to it) at the solver the model has now, under ``'registered'``, and, when
    ``solver`` (keyword arguments of ``model.set_solver``, e.g. a training grid's ``{'steps': 23}``) solves it another
    way, once more solved that way, under ``'solver'``. Each result names its solver (``solver_of``); the model is
    left solved as it came, whatever happens."""
    out = {'registered': dict(evaluate(model, data, **kwargs), solver=solver_of(model))}
    if not solver:
        return out
    trunk = ode_trunk(model)
    if trunk is None:
        raise TypeError(f'solver={solver} needs an ODE model; {type(model).__name__} has no ODE trunk.')
    with trunk.solver(**solver):
        if solver_of(model) != out['registered']['solver']:
            out['solver'] = dict(evaluate(model, data, **kwargs), solver=solver_of(model))
    return out
