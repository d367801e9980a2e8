"""The one ViT trunk behind every family: a token mixer (dense attention, separable Gaussian) crossed with a depth
integrator (discrete, looped, ODE), and the whole timm model contract on top.
"""
import contextlib
import pickle
import zipfile
from typing import Any, Dict, List, Literal, Optional, Set, Tuple, Union

import torch
from safetensors import SafetensorError
from torch import nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    PatchEmbed, calculate_drop_path_rates, register_notrace_function, register_notrace_module, resample_abs_pos_embed,
    trunc_normal_,
)
from timm.models import build_model_with_cfg, resolve_pretrained_cfg
from timm.models._features import feature_take_indices
from timm.models._input import update_model_input_size
from timm.models.vision_transformer import global_pool_nlc

from ..layers import (
    CenterNorm, DiscreteDepth, FieldBlock, LoopedDepth, OdeDepth, SeparableGaussianMixer, spectral_norm_estimate,
)
from .pretrained import check_local_weights, pretrained_source, tag_model_args, unreadable_weights_message

__all__ = ['DepthVisionTransformer', 'create_depth_vit', 'checkpoint_filter_fn', 'depth_vit_cfg']

DEPTH_MODES = ('discrete', 'looped', 'ode')
POOL_TYPES = ('', 'token', 'avg', 'avgmax', 'max')

# torchdiffeq's solver loop and the Gaussian mixer's grid bookkeeping are data-dependent control flow: keep them
# leaves for torch.fx feature extraction
register_notrace_module(OdeDepth)
register_notrace_module(SeparableGaussianMixer)


_NONFINITE_INPUT = 'The input images contain NaN or Inf values; clean or re-normalize the batch.'


def _given(**options: Any) -> Dict[str, Any]:
    """The options a caller set (timm's create_model drops None kwargs, so None means 'not given')."""
    return {k: v for k, v in options.items() if v is not None}


@register_notrace_function
def check_image_input(
        x: torch.Tensor,
        in_chans: int,
        img_size: Tuple[int, int],
        patch_size: Tuple[int, int],
        dynamic_img_size: bool,
        dynamic_img_pad: bool,
        dtype: torch.dtype = torch.float32,
        check_finite: bool = True,
) -> None:
    """Reject inputs the model cannot use, saying what to do instead of failing deep inside a conv or solver."""
    if x.ndim != 4:
        raise ValueError(f'Expected an image batch [B, C, H, W], got a tensor of shape {tuple(x.shape)}; add the '
                         'batch dimension (x.unsqueeze(0) for one image).')
    B, C, H, W = x.shape
    if C != in_chans:
        raise ValueError(
            f'The model takes {in_chans}-channel images, got {C} channels. Build it with in_chans={C} '
            f'(timm adapts pretrained patch-embedding weights), or convert the images to {in_chans} channels.')
    if not dynamic_img_size:
        if (H, W) != tuple(img_size):
            raise ValueError(
                f'The model was built for {img_size[0]}x{img_size[1]} images, got {H}x{W}. Resize the input, build '
                f'with dynamic_img_size=True to accept any size, or call model.set_input_size(img_size=({H}, {W})).')
    elif not dynamic_img_pad and (H % patch_size[0] or W % patch_size[1]):
        raise ValueError(
            f'Image size {H}x{W} is not divisible by the patch size {patch_size[0]}x{patch_size[1]}. Resize or crop '
            'to a multiple of the patch size, or build with dynamic_img_pad=True to pad.')
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        if not x.is_floating_point():
            # integer pixels (uint8 images): the model cannot take that dtype, the input must be converted
            raise ValueError(
                f'The model takes {dtype} images, got {x.dtype} pixels. Convert them: x = x.to({dtype}) / 255, then '
                "normalise with the model's mean and std (timm.data.resolve_data_config(model=model)); or build the "
                'batch from PIL images with timm.data.create_transform(**data_config), as timm does.')
        raise ValueError(
            f'The model takes {dtype} images, got {x.dtype}. Cast the input (x.to({dtype})), cast the model '
            f'(model.to({x.dtype})), or run under torch.autocast.')
    if check_finite and x.device.type == 'cpu':
        # elsewhere it would be a device-side assert, which ends the device context (timm's models check nothing)
        check_finite_async(x)


def check_finite_async(x: torch.Tensor) -> None:
    """Refuse NaN/Inf pixels without a host read: ``torch._assert_async``, which raises at once on the CPU."""
    try:
        torch._assert_async(torch.isfinite(x).all(), _NONFINITE_INPUT)
    except RuntimeError as e:
        if _NONFINITE_INPUT not in str(e):
            raise
        raise ValueError(_NONFINITE_INPUT) from None


class DepthVisionTransformer(nn.Module):
    """A ViT whose blocks are vector fields f(x) = mixer(CN(x)) + MLP(CN(x)), integrated over depth.

    ``mixer`` picks the token mixer ('attention', 'ssog', or 'identity' for cost floors), ``depth_mode`` picks the
    integrator ('discrete': ``depth`` blocks; 'looped': one block ``depth`` times; 'ode': dx/dt = f(x) over
    [0, ``ode_t_end``] with ``depth`` output layers). Everything else is shared, so two models that differ only in
    ``mixer`` are matched twins.
    """

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: Union[int, Tuple[int, int]] = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: Literal['', 'token', 'avg', 'avgmax', 'max'] = 'token',
            embed_dim: int = 768,
            depth: int = 12,
            num_heads: int = 12,
            mlp_ratio: float = 4.,
            mixer: Literal['attention', 'ssog', 'identity'] = 'attention',
            depth_mode: Literal['discrete', 'looped', 'ode'] = 'discrete',
            bias: bool = False,
            num_gaussians: Optional[int] = None,
            learn_offset: Optional[bool] = None,
            prefix_mixing: Optional[Literal['mean', 'none']] = None,
            ssog_steer: Optional[bool] = None,
            ssog_mixing: Optional[Literal['auto', 'operator', 'fused', 'accumulate', 'einsum']] = None,
            ode_method: Optional[str] = None,
            ode_steps: Optional[int] = None,
            ode_t_end: Optional[float] = None,
            ode_rtol: Optional[float] = None,
            ode_atol: Optional[float] = None,
            ode_adjoint: Optional[bool] = None,
            ode_max_nfe: Optional[int] = None,
            class_token: bool = True,
            reg_tokens: int = 0,
            final_norm: bool = True,
            dynamic_img_size: bool = False,
            dynamic_img_pad: bool = False,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: Optional[float] = None,
            drop_path_rate: float = 0.,
            weight_init: Literal['spectral', 'xavier', 'skip'] = 'spectral',
            check_finite: bool = True,
            device=None,
            dtype=None,
    ) -> None:
        """
        Args:
            img_size, patch_size, in_chans: Input size the position embedding is built for, patch size, channels.
            num_classes: Number of classes of the head (0 for none).
            global_pool: Pooling before the head: 'token' (CLS), 'avg', 'avgmax', 'max' or '' (none).
            embed_dim: Token width.
            depth: Number of layers: blocks (discrete), loops (looped) or output points (ode).
            num_heads: Heads of the mixer.
            mlp_ratio: MLP hidden width over embed_dim.
            mixer: Token mixer of every block.
            depth_mode: Depth integrator.
            bias: Biases in the mixer and MLP linears (ODE-ViT has none).
            num_gaussians: Gaussian components per head (ssog only; default 4).
            learn_offset: Learn the Gaussians' centre offsets as well as their widths (ssog only).
            prefix_mixing: What CLS/register tokens receive from an ssog mixer: 'mean' of patches or 'none'.
            ssog_steer: Let each token steer the Gaussians (ssog only; default False): bounded per-position
                residuals on centre, width and mixture weight, zero at initialisation. Steered kernels have no
                global Lipschitz bound, so the ODE families keep fixed kernels by default.
            ssog_mixing: How the fixed kernels are applied (ssog only): 'auto' (``choose_mixing_path``) or one of
                'operator', 'fused', 'triton', 'accumulate', 'einsum' (docs/benchmark.md, "Mixing paths").
            ode_method: ODE method (ode only; default 'euler'): a fixed-grid or an adaptive one, see OdeDepth.
            ode_steps: Uniform solver steps for fixed-grid methods (ode only; default: depth).
            ode_t_end: End of the integration interval (ode only; default: depth, i.e. unit steps).
            ode_rtol, ode_atol: Tolerances of adaptive methods (ode only; default 1e-3, 1e-4).
            ode_adjoint: Backpropagate through the adjoint ODE instead of the solver steps (ode only).
            ode_max_nfe: Cap on function evaluations per solve (ode only; default 1000).
            class_token: Use a class token.
            reg_tokens: Number of register tokens (no position embedding, as in ODE-ViT).
            final_norm: CenterNorm after the trunk.
            dynamic_img_size, dynamic_img_pad: Accept any input size (the position embedding resampled); pad inputs
                not divisible by the patch size.
            drop_rate, proj_drop_rate, attn_drop_rate: Dropout of the head, after the projections, of the
                attention maps (dense attention).
            drop_path_rate: Stochastic depth (discrete and looped only: it would make an ODE field random).
            weight_init: 'spectral' (ODE-ViT: Xavier-normal, then divided by the largest singular value),
                'xavier', or 'skip'.
            check_finite: Refuse NaN/Inf pixels with a ValueError before any work, on the CPU (docs/core.md).

        Options of another mixer or depth setting (``num_gaussians`` on a dense model, ``ode_steps`` on a discrete
        one, ``attn_drop_rate`` without attention) raise TypeError, as unknown kwargs do: nothing is silently ignored.
        """
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if global_pool not in POOL_TYPES:
            raise ValueError(f'Unknown global_pool {global_pool!r}; choose one of {POOL_TYPES}.')
        if global_pool == 'token' and not class_token:
            raise ValueError("global_pool='token' needs class_token=True.")
        if depth_mode not in DEPTH_MODES:
            raise ValueError(f'Unknown depth_mode {depth_mode!r}; choose one of {DEPTH_MODES}.')
        if depth_mode == 'ode' and drop_path_rate > 0:
            raise ValueError('drop_path_rate must be 0 for ODE trunks: a randomly dropped field has no solution; '
                             'use proj_drop_rate for regularization.')
        ssog_options = _given(num_gaussians=num_gaussians, learn_offset=learn_offset, prefix_mixing=prefix_mixing,
                              ssog_steer=ssog_steer, ssog_mixing=ssog_mixing)
        ode_kwargs = _given(method=ode_method, steps=ode_steps, t_end=ode_t_end, rtol=ode_rtol, atol=ode_atol,
                            adjoint=ode_adjoint, max_nfe=ode_max_nfe)
        if ssog_options and mixer != 'ssog':
            raise TypeError(f'{", ".join(ssog_options)} apply to the ssog mixer only; this model has mixer={mixer!r}.')
        mixer_kwargs = {k[len('ssog_'):] if k.startswith('ssog_') else k: v for k, v in ssog_options.items()}
        if attn_drop_rate is not None and mixer != 'attention':
            raise TypeError(f'attn_drop_rate applies to attention only; this model has mixer={mixer!r}.')
        if ode_kwargs and depth_mode != 'ode':
            raise TypeError(f'{", ".join("ode_" + k for k in ode_kwargs)} apply to ODE trunks only; this model has '
                            f'depth_mode={depth_mode!r}.')
        if weight_init not in ('spectral', 'xavier', 'skip'):
            raise ValueError(f"weight_init must be 'spectral', 'xavier' or 'skip', got {weight_init!r}.")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.has_class_token = class_token
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = int(class_token) + reg_tokens
        self.mixer_name = mixer
        self.depth_mode = depth_mode
        self.dynamic_img_size = dynamic_img_size
        self.dynamic_img_pad = dynamic_img_pad
        self.check_finite = check_finite
        self.grad_checkpointing = False

        embed_args = dict(strict_img_size=False, output_fmt='NHWC') if dynamic_img_size else {}
        self.patch_embed = PatchEmbed(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            dynamic_img_pad=dynamic_img_pad,
            **embed_args,
            **dd,
        )
        reduction = self.patch_embed.feat_ratio()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim, **dd)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim, **dd)) if reg_tokens else None
        # CLS and patches carry a position, registers do not (as in ODE-ViT)
        self.pos_embed = nn.Parameter(
            torch.zeros(1, self.patch_embed.num_patches + int(class_token), embed_dim, **dd))

        block_args = dict(
            dim=embed_dim,
            num_heads=num_heads,
            mixer=mixer,
            mlp_ratio=mlp_ratio,
            bias=bias,
            proj_drop=proj_drop_rate,
            attn_drop=attn_drop_rate or 0.,
            mixer_kwargs=mixer_kwargs,
            **dd,
        )
        if depth_mode == 'discrete':
            dpr = calculate_drop_path_rates(drop_path_rate, depth)
            self.trunk = DiscreteDepth([FieldBlock(drop_path=dpr[i], **block_args) for i in range(depth)])
            feature_modules = [f'trunk.blocks.{i}' for i in range(depth)]
        elif depth_mode == 'looped':
            self.trunk = LoopedDepth(FieldBlock(drop_path=drop_path_rate, **block_args), num_loops=depth)
            feature_modules = [f'trunk.block.{i}' for i in range(depth)]
        else:
            self.trunk = OdeDepth(FieldBlock(**block_args), num_layers=depth, **ode_kwargs)
            feature_modules = [f'trunk.t{i}' for i in range(depth)]
        self.feature_info = [dict(module=m, num_chs=embed_dim, reduction=reduction) for m in feature_modules]
        self.norm = CenterNorm(embed_dim, **dd) if final_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()

        if weight_init != 'skip':
            self.init_weights(weight_init)

    @torch.no_grad()
    def init_weights(self, mode: str = 'spectral') -> None:
        """Position embedding trunc-normal(0.02), tokens normal(1e-6), every Linear Xavier-normal (and, with
        'spectral', divided by a power-iteration estimate of its largest singular value, so each starts with
        spectral norm 1 to within a few percent), biases zero."""
        if any(p.is_meta for p in self.parameters()):
            return  # shapes only: nothing to initialise
        trunc_normal_(self.pos_embed, std=.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                if mode == 'spectral':
                    m.weight.div_(spectral_norm_estimate(m.weight).to(m.weight))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif hasattr(m, 'reset_kernel_parameters'):
                m.reset_kernel_parameters()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        kernel_params = {n for n, _ in self.named_parameters()
                         if n.endswith(('log_sigma', 'offset', 'mix_logits', 'steer_gate'))}
        return {'pos_embed', 'cls_token', 'reg_token'} | kernel_params

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        if isinstance(self.trunk, DiscreteDepth):
            blocks = [(r'^trunk\.blocks\.(\d+)', None), (r'^norm', (99999,))]
        else:
            blocks = [(r'^trunk\.', (0,)), (r'^norm', (99999,))]
        return dict(stem=r'^cls_token|^reg_token|^pos_embed|^patch_embed', blocks=blocks)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        self.trunk.set_grad_checkpointing(enable)

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in POOL_TYPES:
                raise ValueError(f'Unknown global_pool {global_pool!r}; choose one of {POOL_TYPES}.')
            if global_pool == 'token' and not self.has_class_token:
                raise ValueError("global_pool='token' needs a class token.")
            self.global_pool = global_pool
        self.num_classes = num_classes
        ref = self.pos_embed
        self.head = nn.Linear(self.embed_dim, num_classes, device=ref.device, dtype=ref.dtype) \
            if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    def set_input_size(
            self,
            img_size: Optional[Tuple[int, int]] = None,
            patch_size: Optional[Tuple[int, int]] = None,
    ) -> None:
        """Rebuild for a new input size (and patch size), resampling the position embedding."""
        prev_grid_size = self.patch_embed.grid_size
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        if self.patch_embed.grid_size != prev_grid_size:
            self.pos_embed = nn.Parameter(resample_abs_pos_embed(
                self.pos_embed,
                new_size=self.patch_embed.grid_size,
                old_size=prev_grid_size,
                num_prefix_tokens=int(self.has_class_token),
            ), requires_grad=self.pos_embed.requires_grad)
        update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)

    def set_solver(self, **kwargs: Any) -> None:
        """Change the ODE solver of a built model: method, steps, rtol, atol, adjoint, max_nfe."""
        if not isinstance(self.trunk, OdeDepth):
            raise TypeError(f'set_solver needs an ODE trunk; this model has depth_mode={self.depth_mode!r}.')
        self.trunk.set_solver(**kwargs)

    @property
    def nfe(self) -> int:
        """Block (vector-field) evaluations in the last forward pass."""
        return self.trunk.nfe

    @torch.no_grad()
    def lipschitz_bound(self, grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Upper bound of the Lipschitz constant of the trunk's vector field(s) (max over blocks), for the current
        weights on a patch grid (default: the built one). Finite only for Lipschitz mixers (ssog, identity)."""
        grid_size = grid_size or self.patch_embed.grid_size
        bounds = [b.lipschitz_bound(grid_size, self.num_prefix_tokens) for b in self.trunk.field_blocks()]
        return torch.stack(bounds).max()

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        check_image_input(
            x, self.in_chans, self.patch_embed.img_size, self.patch_embed.patch_size,
            self.dynamic_img_size, self.dynamic_img_pad, self.pos_embed.dtype, self.check_finite)
        x = self.patch_embed(x)
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            pos_embed = resample_abs_pos_embed(
                self.pos_embed,
                new_size=(H, W),
                old_size=self.patch_embed.grid_size,
                num_prefix_tokens=int(self.has_class_token),
            )
            x = x.reshape(B, H * W, C)
            grid_size = (H, W)
        else:
            pos_embed = self.pos_embed
            grid_size = self.patch_embed.grid_size
        B = x.shape[0]
        num_cls = int(self.has_class_token)
        to_cat = []
        if self.cls_token is not None:
            to_cat.append((self.cls_token + pos_embed[:, :1]).expand(B, -1, -1))
        if self.reg_token is not None:
            to_cat.append(self.reg_token.expand(B, -1, -1))
        x = x + pos_embed[:, num_cls:]
        if to_cat:
            x = torch.cat(to_cat + [x], dim=1)
        return x, grid_size

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Features after the chosen layers (blocks, loops, or ODE output times) and the final features.

        Args:
            x: Input images.
            indices: Take the last n layers if an int, all if None, these layers if a sequence.
            return_prefix_tokens: Return (patch tokens, prefix tokens) pairs.
            norm: Apply the final norm to each intermediate.
            stop_early: Stop integrating after the last requested layer.
            output_fmt: 'NCHW' or 'NLC'.
            intermediates_only: Return only the intermediates.
        """
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}.")
        take_indices, max_index = feature_take_indices(self.trunk.num_layers, indices)
        B, _, height, width = x.shape
        x, grid_size = self._embed(x)
        x, intermediates = self.trunk(x, grid_size, take_indices=take_indices, stop_early=stop_early)
        if norm:
            intermediates = [self.norm(y) for y in intermediates]
        prefix_tokens = [y[:, :self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == 'NCHW':
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens and self.num_prefix_tokens:
            intermediates = list(zip(intermediates, prefix_tokens))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the layers (blocks, loops, or ODE interval) after the last one needed for ``indices``."""
        take_indices, max_index = feature_take_indices(self.trunk.num_layers, indices)
        self.trunk.prune(max_index + 1)
        self.feature_info = self.feature_info[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, grid_size = self._embed(x)
        x, _ = self.trunk(x, grid_size)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = global_pool_nlc(x, pool_type=self.global_pool, num_prefix_tokens=self.num_prefix_tokens)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        return self.forward_head(x)

    def forward_trajectory(
            self,
            x: torch.Tensor,
            times: Union[torch.Tensor, List[float]],
            return_attn: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Trunk states at depth ``times`` from one integration (for trajectory distillation).

        Times are in the trunk's depth units: an ODE trunk takes strictly increasing times in (0, t_end]; a discrete
        or looped trunk takes layer numbers 1..L (layer i's output sits at time i + 1, as an Euler step of size 1).

        Returns:
            (final tokens after the final norm [B, N, D], states before the norm [len(times), B, N, D], and with
            ``return_attn`` the attention maps [B, heads, N, N] of the last field evaluation, else None).
        """
        # a list of floats is the compile-friendly form: a tensor is read back to the host (a graph break)
        times = [float(t) for t in (times.flatten().tolist() if isinstance(times, torch.Tensor) else times)]
        if not times or any(b <= a for a, b in zip(times[:-1], times[1:])):
            raise ValueError(f'times must be a non-empty, strictly increasing sequence, got {times}.')
        block = self.trunk.field_blocks()[-1]
        if return_attn and not getattr(block.mixer, 'supports_attn_maps', False):
            raise TypeError(f'{type(block.mixer).__name__} cannot return attention maps; only dense attention can.')
        x, grid_size = self._embed(x)
        if isinstance(self.trunk, OdeDepth):
            t_end = self.trunk.t_end
            ends_early = times[-1] < t_end * (1 - 1e-6)
            all_states, last_input = self.trunk.solve(
                x, grid_size, times + [t_end] if ends_early else times, return_last_input=True)
            final, states = all_states[-1], all_states[:len(times)]
        else:
            layers = [round(t) for t in times]
            off_grid = any(abs(t - n) > 1e-6 for t, n in zip(times, layers))
            if off_grid or layers[0] < 1 or layers[-1] > self.trunk.num_layers:
                raise ValueError(f'A {self.depth_mode} trunk has states only at layers 1..{self.trunk.num_layers}; '
                                 f'got times {times}.')
            take = [n - 1 for n in layers]
            # the last block's input is the state after layer L - 1 (the embedding when L == 1)
            before_last = self.trunk.num_layers - 2
            needed = sorted(set(take + ([before_last] if return_attn and before_last >= 0 else [])))
            final, state_list = self.trunk(x, grid_size, take_indices=needed)
            by_index = dict(zip(needed, state_list))
            states = torch.stack([by_index[i] for i in take])
            last_input = by_index.get(before_last, x)
        # the solver evaluates the field many times: recompute the map of its last evaluation once (an explicit map
        # at every evaluation would cost the fused attention path on each)
        attn = block.mixer(block.norm_mixer(last_input), grid_size, return_attn=True)[1] if return_attn else None
        return self.norm(final), states, attn


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: DepthVisionTransformer) -> Dict[str, torch.Tensor]:
    """Adapt a checkpoint to ``model``: unwrap training wrappers, resample the position embedding to its grid."""
    for key in ('state_dict', 'model', 'state_dict_ema'):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
            break
    bad = [k for k, v in state_dict.items() if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()]
    if bad:
        cfg = getattr(model, 'pretrained_cfg', None) or {}
        where = cfg.get('file') or cfg.get('hf_hub_id') or 'the checkpoint'
        raise RuntimeError(f'The pretrained weights from {where} hold NaN or Inf values ({len(bad)} tensors, e.g. '
                           f'{bad[0]}): the file is damaged or was saved from a diverged run; get a good copy.')
    out = {}
    for k, v in state_dict.items():
        k = k[len('module.'):] if k.startswith('module.') else k
        if k == 'pos_embed' and v.shape != model.pos_embed.shape:
            num_cls = int(model.has_class_token)
            old_tokens = v.shape[1] - num_cls
            old_side = int(round(old_tokens ** 0.5))
            if old_side * old_side != old_tokens:
                raise ValueError(f'Checkpoint pos_embed of shape {tuple(v.shape)} is not a square grid; cannot '
                                 f'resample it to {tuple(model.pos_embed.shape)}: build the model at the grid the '
                                 'checkpoint was trained at.')
            v = resample_abs_pos_embed(
                v, new_size=model.patch_embed.grid_size, old_size=(old_side, old_side), num_prefix_tokens=num_cls)
        out[k] = v
    # a steered mixer starts as the fixed one: fixed weights load into it with its steering at its initial values
    for k, v in model.state_dict().items():
        if k not in out and k.rsplit('.', 1)[-1] in ('steer_gate', 'steer_weight'):
            out[k] = v
    return out


def _published_tag(variant: str) -> Optional[str]:
    """The first tag of ``variant`` with published weights, when its untagged default has none."""
    from timm.models import get_pretrained_cfg, list_pretrained
    default = get_pretrained_cfg(variant)
    if default is not None and (default.hf_hub_id or default.url or default.file):
        return None
    tagged = list_pretrained(f'{variant}.*')
    return tagged[0].split('.', 1)[1] if tagged else None


def create_depth_vit(variant: str, pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    """Build a registered variant through timm's builder (pretrained loading, features_only, cfg plumbing).

    Our untagged cfgs stay the architecture's defaults (3 channels, 1000 classes; models.pretrained), so
    ``pretrained=True`` without a tag loads the variant's first published tag instead of failing for want of weights.
    """
    if pretrained and kwargs.get('pretrained_cfg') is None:
        tag = _published_tag(variant)
        if tag is not None:
            kwargs['pretrained_cfg'] = tag
    # a tag asked for by name solves as it was trained, as timm's hf-hub: route applies config.json's model_args;
    # a kwarg the caller passes wins (hf-hub: passes a dict cfg, whose model_args timm has applied already)
    tag_args = tag_model_args(variant, kwargs['pretrained_cfg']) if isinstance(kwargs.get('pretrained_cfg'), str) \
        else {}
    for k, v in tag_args.items():
        kwargs.setdefault(k, v)
    source = contextlib.nullcontext()
    if pretrained:
        cfg = resolve_pretrained_cfg(variant, kwargs.get('pretrained_cfg'), kwargs.get('pretrained_cfg_overlay'))
        source = pretrained_source(cfg.hf_hub_id, cfg.file)
        if cfg.source == 'local-dir':
            check_local_weights(cfg.file)
    out_indices = kwargs.pop('out_indices', 3)
    feature_cls = kwargs.get('feature_cls', 'getter')
    if kwargs.get('features_only') and feature_cls != 'getter' and kwargs.get('depth_mode', 'discrete') != 'discrete':
        raise ValueError(
            f"feature_cls={feature_cls!r} needs a module per layer; the layers of a {kwargs['depth_mode']} trunk are "
            "applications of one block (or ODE output times), not modules. Use feature_cls='getter' (the default), "
            'which reads them through forward_intermediates.')
    with source:
        try:
            model = build_model_with_cfg(
                DepthVisionTransformer,
                variant,
                pretrained,
                pretrained_filter_fn=checkpoint_filter_fn,
                feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
                **kwargs,
            )
        except (SafetensorError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError) as e:
            if isinstance(e, RuntimeError) and 'PytorchStreamReader' not in str(e):
                raise
            raise RuntimeError(unreadable_weights_message(cfg, e)) from e
    # timm's create_model records only the caller's kwargs for save_for_hf's config.json; the tag's go in too, so
    # that a re-serialised model keeps its solver
    model._model_args = {k: kwargs[k] for k in tag_args}
    return model


def depth_vit_cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    """Pretrained config defaults shared by every family (224 px, patch embedding first, 'head' classifier)."""
    return {
        'url': url,
        'num_classes': 1000,
        'input_size': (3, 224, 224),
        'pool_size': None,
        'crop_pct': 0.9,
        'interpolation': 'bicubic',
        'fixed_input_size': True,
        'mean': IMAGENET_DEFAULT_MEAN,
        'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj',
        'classifier': 'head',
        'license': 'apache-2.0',
        **kwargs,
    }


# small-image variants (patch 4 at 32 px) for CIFAR / Fashion-MNIST scale work
SMALL_IMAGE_ARGS = dict(img_size=32, patch_size=4)
SMALL_IMAGE_CFG = dict(input_size=(3, 32, 32), crop_pct=1.0)
WIDTHS = {
    'tiny': dict(embed_dim=192, num_heads=3),
    'small': dict(embed_dim=384, num_heads=6),
    'base': dict(embed_dim=768, num_heads=12),
}
