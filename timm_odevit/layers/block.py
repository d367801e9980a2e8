"""The vector-field block shared by every depth setting: f(x) = mixer(CN_a(x)) + mlp(CN_m(x))."""
from typing import Any, Dict, Optional, Sequence, Tuple, Type

import torch
from torch import nn
from timm.layers import DropPath, Mlp

from .linalg import spectral_norm
from .mixers import create_mixer
from .norm import CenterNorm

__all__ = ['FieldBlock']

# sup |GELU'(x)| = 1.128904... (at x = sqrt(2)), rounded up so that the bound stays a bound
GELU_LIPSCHITZ = 1.12891


class FieldBlock(nn.Module):
    """A transformer block written as a vector field, mixer and MLP in parallel on the same input.

    It returns the update f(x), not x + f(x): the depth integrator decides how updates are applied (one residual
    step per block, one shared block looped, or an ODE solver), which is what lets the discrete, looped and
    continuous trunks share this one block.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mixer: str = 'attention',
            mlp_ratio: float = 4.,
            bias: bool = False,
            norm_layer: Type[nn.Module] = CenterNorm,
            act_layer: Type[nn.Module] = nn.GELU,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            drop_path: float = 0.,
            mixer_kwargs: Optional[Dict[str, Any]] = None,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.norm_mixer = norm_layer(dim, **dd)
        self.mixer = create_mixer(
            mixer, dim, num_heads, bias=bias, attn_drop=attn_drop, proj_drop=proj_drop, **(mixer_kwargs or {}), **dd)
        self.norm_mlp = norm_layer(dim, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, bias=bias, drop=proj_drop, **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def field_constants(
            self, grid_size: Tuple[int, int], shape: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        """What the mixer computes from its weights alone for a grid and states of ``shape`` (SSoG kernels): a depth
        integrator asks once per forward and passes it to every evaluation as ``forward(x, grid_size,
        **constants)``."""
        fn = getattr(self.mixer, 'field_constants', None)
        return {'mixer_constants': fn(grid_size, shape)} if fn is not None else {}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if hasattr(self.mixer, 'set_grad_checkpointing'):
            self.mixer.set_grad_checkpointing(enable)

    def forward(
            self, x: torch.Tensor, grid_size: Tuple[int, int], mixer_constants: Optional[Dict[str, Any]] = None,
    ) -> torch.Tensor:
        mixed = self.mixer(self.norm_mixer(x), grid_size, **(mixer_constants or {}))
        return self.drop_path(mixed + self.mlp(self.norm_mlp(x)))

    @torch.no_grad()
    def lipschitz_bound(self, grid_size: Tuple[int, int], num_prefix_tokens: int = 0) -> torch.Tensor:
        """Upper bound of the field's Lipschitz constant, when its mixer has one (SSoG, identity)."""
        if not hasattr(self.mixer, 'lipschitz_bound'):
            raise TypeError(f'{type(self.mixer).__name__} has no global Lipschitz bound (softmax attention is not '
                            'globally Lipschitz): build the model with mixer="ssog" (fixed kernels) for one.')
        mixer = self.mixer.lipschitz_bound(grid_size, num_prefix_tokens) * self.norm_mixer.lipschitz_bound()
        fc1 = spectral_norm(self.mlp.fc1.weight)
        fc2 = spectral_norm(self.mlp.fc2.weight)
        mlp = fc2 * GELU_LIPSCHITZ * fc1 * self.norm_mlp.lipschitz_bound()
        return mixer + mlp
