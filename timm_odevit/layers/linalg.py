"""Spectral norms of weight matrices: exact for the Lipschitz bounds, estimated for the spectral init."""
import torch

__all__ = ['spectral_norm', 'spectral_norm_estimate']


@torch.no_grad()
def spectral_norm(weight: torch.Tensor) -> torch.Tensor:
    """Largest singular value of a 2-D weight (exact: a Lipschitz bound must never be below the truth).

    The square root of the largest eigenvalue of the smaller Gram matrix in float64, on one thread: multi-threaded
    LAPACK on a busy CPU took up to half a second per matrix, single-threaded it is milliseconds for small widths.
    """
    w = weight.detach().double().cpu()
    gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        top = torch.linalg.eigvalsh(gram)[-1]
    finally:
        torch.set_num_threads(threads)
    return top.clamp_min(0).sqrt().float().to(weight.device)


@torch.no_grad()
def spectral_norm_estimate(weight: torch.Tensor, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Power-iteration estimate of the largest singular value (from below, within a few percent for 20 iterations
    on Xavier-initialised matrices): cheap enough to run on every Linear of a base-size model at construction."""
    w = weight.detach().float()
    g = torch.Generator(device=w.device).manual_seed(seed)
    v = torch.randn(w.shape[1], generator=g, device=w.device)
    for _ in range(iters):
        v = w.T @ (w @ v)
        v = v / v.norm().clamp_min(1e-12)
    return (w @ v).norm()
