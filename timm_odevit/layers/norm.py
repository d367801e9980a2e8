"""CenterNorm (LipsFormer): LayerNorm without the variance division, so it stays globally Lipschitz."""
import torch
from torch import nn


class CenterNorm(nn.Module):
    """Subtract the feature mean, rescale by D / (D - 1), then a learned affine.

    Dividing by the standard deviation (as LayerNorm does) has an unbounded Lipschitz constant near zero
    variance; centering is a projection, so this norm's Lipschitz constant is D / (D - 1) * max|weight|.
    """

    def __init__(self, dim: int, elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim = dim
        self.scale = dim / (dim - 1) if dim > 1 else 1.0
        self.weight = nn.Parameter(torch.ones(dim, **dd)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **dd)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - x.mean(dim=-1, keepdim=True)) * self.scale
        if self.weight is not None:
            x = x * self.weight
        if self.bias is not None:
            x = x + self.bias
        return x

    def lipschitz_bound(self) -> torch.Tensor:
        """Upper bound of the Lipschitz constant in the l2 norm (per token)."""
        w = self.weight.detach().abs().max() if self.weight is not None else torch.tensor(1.0)
        return w * self.scale

    def extra_repr(self) -> str:
        return f'{self.dim}, elementwise_affine={self.weight is not None}'
