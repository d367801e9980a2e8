"""Token mixers: dense softmax attention, the separable sum-of-Gaussians mixer, and the identity floor.

Every mixer takes tokens laid out as [prefix tokens (CLS, registers), patch tokens in row-major grid order]
and is called as ``mixer(x, grid_size)``; only the Gaussian mixer needs the grid, the others ignore it.
"""
import contextlib
import math
from typing import Callable, Dict, Final, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from timm.layers import use_fused_attn

from .fused_mixer import HAS_TRITON, einsum_mix, kernel_from_log_factors, negligible_weight, separable_mix
from .linalg import spectral_norm

__all__ = ['MultiHeadAttention', 'SeparableGaussianMixer', 'IdentityMixer', 'create_mixer', 'choose_mixing_path',
           'MIXERS', 'MIXING_PATHS', 'TRITON_PROVEN']


class MultiHeadAttention(nn.Module):
    """Softmax multi-head self-attention.

    With ``bias=False`` this is the ODE-ViT attention; with the same settings as a ``SeparableGaussianMixer``
    it is that mixer's dense twin. Fused through ``F.scaled_dot_product_attention`` as timm's ``Attention`` is
    (``timm.layers.use_fused_attn()`` / ``set_fused_attn`` decide, and ``fused_attn`` can be set per module), unless
    the attention maps are asked for, in which case they are computed explicitly and returned. ``fused_attn=False``
    is the eager baseline that materialises the N x N maps, as ODE-ViT's code runs it.
    """
    supports_attn_maps = True
    fused_attn: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            bias: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if dim % num_heads:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads}).')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = use_fused_attn()
        self.qkv = nn.Linear(dim, dim * 3, bias=bias, **dd)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim, bias=bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
            self,
            x: torch.Tensor,
            grid_size: Optional[Tuple[int, int]] = None,
            return_attn: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn_drop = self.attn_drop if self.training else 0.
        if self.fused_attn and not return_attn:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=attn_drop)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            out = F.dropout(attn, attn_drop) @ v
        out = self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
        return (out, attn) if return_attn else out


def _mix_accumulate(p: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """sum_k G^y_k P G^x_k^T on the head-major layout P [heads, H, c, W], accumulated one component at a time.

    With rows first and columns last, both axes are plain bmm over heads with no copy of the values: the y axis is
    [H, H] @ [H, c * W], the x axis [H * c, W] @ [W, W]. Peak extra: one value-sized temporary and the result.
    """
    h, H, c, W = p.shape
    out = None
    for k in range(gx.shape[1]):
        t = torch.bmm(gy[:, k], p.reshape(h, H, c * W)).reshape(h, H * c, W)
        gxt = gx[:, k].transpose(1, 2)
        out = torch.bmm(t, gxt) if out is None else out.baddbmm_(t, gxt)
        del t
    return out.reshape(h, H, c, W)


def _head_major(v: torch.Tensor, num_prefix: int, H: int, W: int, heads: int) -> torch.Tensor:
    """Patch values of v [B, N, C] as [heads, H, B * d, W], the accumulate path's layout."""
    B, _, C = v.shape
    d = C // heads
    return v[:, num_prefix:].reshape(B, H, W, heads, d).permute(3, 1, 0, 4, 2).reshape(heads, H, B * d, W)


class _SeparableMixFn(torch.autograd.Function):
    """The accumulate path with a backward that keeps no value-sized tensor of its own.

    The mixing is linear in the values, so their gradient is the same mixing with transposed kernels; the kernels'
    gradients need the values, which backward recomputes from the value projection's input (``x``, ``weight``,
    ``bias``): the projection keeps ``x`` for its own weight gradient anyway, so saving it here costs nothing.
    Only ``p`` receives a gradient; ``x`` and the projection get theirs through the projection that made ``p``.
    """

    @staticmethod
    def forward(ctx, p: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], num_prefix: int, H: int, W: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias, gx, gy)
        ctx.layout = (num_prefix, H, W, p.shape[0], p.dtype)
        return _mix_accumulate(p, gx, gy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, bias, gx, gy = ctx.saved_tensors
        num_prefix, H, W, h, dtype = ctx.layout
        grad = grad.contiguous().to(dtype)
        c = grad.shape[2]
        grad_p = grad_gx = grad_gy = None
        if ctx.needs_input_grad[0]:
            # Y = G^y P G^x^T  =>  dP = G^y^T dY G^x
            grad_p = _mix_accumulate(grad, gx.transpose(-1, -2), gy.transpose(-1, -2))
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # the values again, as the forward made them (in its dtype: bf16 under autocast)
            with torch.no_grad():
                v = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
                p = _head_major(v, num_prefix, H, W, h)
                del v
            gxs, gys = [], []
            for k in range(gx.shape[1]):
                if ctx.needs_input_grad[1]:
                    # Y_k = B_k G^x_k^T with B_k = G^y_k P: dG^x_k = dY^T B_k over (rows, channels)
                    b = torch.bmm(gy[:, k], p.reshape(h, H, c * W)).reshape(h, H * c, W)
                    gxs.append(torch.bmm(grad.reshape(h, H * c, W).transpose(1, 2), b))
                    del b
                if ctx.needs_input_grad[2]:
                    # Y_k = G^y_k A_k with A_k = P G^x_k^T: dG^y_k = dY A_k^T over (channels, columns)
                    a = torch.bmm(p.reshape(h, H * c, W), gx[:, k].transpose(1, 2)).reshape(h, H, c * W)
                    gys.append(torch.bmm(grad.reshape(h, H, c * W), a.transpose(1, 2)))
                    del a
            grad_gx = torch.stack(gxs, 1).to(gx.dtype) if gxs else None
            grad_gy = torch.stack(gys, 1).to(gy.dtype) if gys else None
        return grad_p, grad_gx, grad_gy, None, None, None, None, None, None


def _projected_t(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` transposed, [C, B * N] from x [B, N, C], as one matmul: laid out [heads, d, B, N], so that every
    head's values are a plain matrix for the mixing matmuls, with no copy."""
    xt = x.reshape(-1, x.shape[-1]).t()
    if linear.bias is None:
        return torch.mm(linear.weight, xt)
    return torch.addmm(linear.bias[:, None], linear.weight, xt)


def _grid_operator(gy: torch.Tensor, gx: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """sum_k a_k G^y_k kron G^x_k: the [heads, H W, H W] matrix that mixes the patches of one head."""
    heads, H, W = gy.shape[0], gy.shape[-1], gx.shape[-1]
    return torch.einsum('hk,hkac,hkbd->habcd', mix, gy, gx).reshape(heads, H * W, H * W)


def _token_operator_t(gy: torch.Tensor, gx: torch.Tensor, mix: torch.Tensor, num_prefix: int,
                      prefix_mean: bool) -> torch.Tensor:
    """The transposed [heads, N, N] operator of all N tokens: patches mixed by sum_k a_k G^y_k kron G^x_k, prefix
    rows the mean of the patches (or zero), prefix columns zero (patches do not see the prefix)."""
    H, W = gy.shape[-1], gx.shape[-1]
    op = _grid_operator(gy, gx, mix)
    if num_prefix:
        rows = op.new_full((op.shape[0], num_prefix, H * W), 1. / (H * W) if prefix_mean else 0.)
        op = F.pad(torch.cat([rows, op], dim=1), (num_prefix, 0))
    return op.transpose(1, 2)


def _mix_operator(x: torch.Tensor, v: nn.Linear, proj: nn.Linear, op_t: torch.Tensor) -> torch.Tensor:
    """The mixing as one bmm over all tokens with the precomputed operator: Y_h^T = V_h^T Op_h^T on the transposed
    values [heads, d * B, N]; the result [C, B * N] is the output projection's input, transposed. Three matmuls,
    as fused attention's qkv, attention and projection."""
    B, N, C = x.shape
    heads = op_t.shape[0]
    yt = torch.bmm(_projected_t(x, v).view(heads, -1, N), op_t)
    return proj(yt.view(C, B * N).t()).view(B, N, C)


def _build_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels are built in float32 (float64 for a float64 mixer), whatever the mixing runs in: float16 holds neither
    the logits of a narrow Gaussian nor its tails."""
    return torch.promote_types(dtype, torch.float32)


def _mixing_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype the mixing's matmuls run in: autocast's where it is on for the parameters' device, else theirs."""
    device_type = param.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return param.dtype


def _flush(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Kernel entries below ``negligible_weight`` zeroed in the build dtype, then cast to the mixing dtype."""
    return g.masked_fill(g < negligible_weight(g.dtype), 0.).to(dtype)


class MixingConstants(NamedTuple):
    """What one grid's fixed-kernel mixing needs from the kernel parameters alone (``field_constants``): the path that
    will use them and its tensors, kernels in the mixing dtype or the fused op's float32 factors."""
    path: str
    tensors: Tuple[torch.Tensor, ...]


def gaussian_log_factors(size: int, sigma: torch.Tensor, offset: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row-normalized 1-D Gaussians G[..., i, j] ∝ exp(-(i - j - offset)^2 / (2 sigma^2)), ``sigma`` and ``offset`` in
    patches (any leading shape), as log-Toeplitz factors (``kernel_from_log_factors``): ``band`` the logits of i - j =
    1 - size..size - 1, ``rows`` minus each row's log-sum-exp (rows sum to one however small sigma gets)."""
    d = torch.arange(1 - size, size, device=sigma.device, dtype=sigma.dtype)  # i - j
    band = -(d - offset[..., None]) ** 2 / (2 * sigma[..., None] ** 2)
    return band, -band.unfold(-1, size, 1).logsumexp(dim=-1)  # row i reads band[i:i + size]


# bounds of the steered residuals: centre offsets in patches, log-widths (x4 either way), mixture logits
STEER_BOUNDS = (2.0, math.log(4.0), 2.0, math.log(4.0), 4.0)
STEER_FIELDS = 5  # per head and component: x offset, x log-width, y offset, y log-width, mixture logit


def _normalised_gaussians(size: int, out_index: torch.Tensor, log_sigma: torch.Tensor,
                          offset: torch.Tensor) -> torch.Tensor:
    """Row-normalised 1-D Gaussians over a source axis of ``size``, one row per output position:
    P[..., j] = exp(-(i - j - offset)^2 / (2 sigma^2)) / sum_j(...), with ``log_sigma`` and ``offset`` of any shape
    [...] and the output index i broadcast against it. Result [..., size].

    Cheaper than a softmax of the logits: these are multiply-adds in d = i - j (small where the weights are
    large, so no precision is lost), and their row maximum, which a softmax would search for, is known: the
    integer d nearest the centre. Logits are clamped at the log of ``negligible_weight`` (the row's largest
    weight is 1), so no weight is subnormal."""
    a = 0.5 * torch.exp(-2 * log_sigma)  # 1 / (2 sigma^2)
    # the row maximum sits at the d in [i - size + 1, i] nearest the centre: shift it to 0 (it cancels in the
    # normalisation)
    nearest = torch.minimum(torch.maximum(offset.round(), out_index - (size - 1)), out_index)
    shift = a * ((nearest - offset) ** 2 - offset ** 2)
    d = out_index[..., None] - torch.arange(size, device=a.device, dtype=a.dtype)
    g = ((2 * a * offset)[..., None] * d).addcmul_(a[..., None], d * d, value=-1).add_(shift[..., None])
    g = g.clamp_min_(math.log(negligible_weight(a.dtype))).exp_()
    return g.div_(g.sum(-1, keepdim=True))


class _GaussianRowsFn(torch.autograd.Function):
    """``_normalised_gaussians`` times a per-row ``scale`` (the mixture weight, or None), with an analytic backward
    that reads each big tensor about twice.

    For P = softmax_j(l_j), l_j = -a (d_j - m)^2, d_j = i - j, a = 1 / (2 sigma^2) and output G = c P, the logits'
    gradient is q_j = c P_j (g_j - A_0) with A_f = sum_j P_j g_j f_j, and sum_j q_j = 0. So every gradient needs
    only the moments (P * g) @ [1, j, j^2] and P @ [j, j^2]: dL/dc = A_0, dL/dm = -2a sum_j q_j j,
    dL/da = 2 (i - m) sum_j q_j j - sum_j q_j j^2, dL/dlog_sigma = -2a dL/da. Autograd through the forward's
    elementwise chain would read and write them a dozen times.
    """

    @staticmethod
    def forward(ctx, log_sigma: torch.Tensor, offset: torch.Tensor, out_index: torch.Tensor, size: int,
                scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        p = _normalised_gaussians(size, out_index, log_sigma, offset)
        if not any(ctx.needs_input_grad):  # inference: scaled in place, nothing kept
            return p if scale is None else p.mul_(scale[..., None])
        ctx.save_for_backward(p, log_sigma, offset, out_index, scale)
        return p if scale is None else p * scale[..., None]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, log_sigma, offset, out_index, scale = ctx.saved_tensors
        size = p.shape[-1]
        j = torch.arange(size, device=p.device, dtype=p.dtype)
        basis = torch.stack([torch.ones_like(j), j, j * j], dim=1)  # [size, 3]
        # plain 2-D mm on flat views: torch.matmul copies a many-dimensional operand first
        pg = torch.mm((p * grad.to(p.dtype)).reshape(-1, size), basis).reshape(*p.shape[:-1], 3)
        pj = torch.mm(p.reshape(-1, size), basis[:, 1:]).reshape(*p.shape[:-1], 2)
        a0 = pg[..., 0]
        qj, qj2 = pg[..., 1] - a0 * pj[..., 0], pg[..., 2] - a0 * pj[..., 1]
        if scale is not None:
            qj, qj2 = scale * qj, scale * qj2
        a = 0.5 * torch.exp(-2 * log_sigma)
        grad_a = 2 * (out_index - offset) * qj - qj2
        grad_ls = (-2 * a * grad_a).sum_to_size(log_sigma.shape) if ctx.needs_input_grad[0] else None
        grad_m = (-2 * a * qj).sum_to_size(offset.shape) if ctx.needs_input_grad[1] else None
        grad_scale = a0.sum_to_size(scale.shape) if scale is not None and ctx.needs_input_grad[4] else None
        return grad_ls, grad_m, None, None, grad_scale


def _steered_columns(v: torch.Tensor, sx: torch.Tensor, mx: torch.Tensor, sy: torch.Tensor, my: torch.Tensor,
                     mix: torch.Tensor, j0: int) -> torch.Tensor:
    """One chunk of output columns j0.. of the steered mixing: head-major values ``v`` [B, heads, H, W, d]; the
    chunk's x-stage widths and centres ``sx``, ``mx`` [B, heads, H, n, K], query widths, centres and mixture
    weights ``sy``, ``my``, ``mix`` [B, heads, n, H, K]. Result [B, heads, n, H, d]."""
    B, heads, H, W, d = v.shape
    n, K = sx.shape[-2:]
    cols = torch.arange(j0, j0 + n, device=v.device, dtype=sx.dtype)[:, None]  # output column j, against K
    rows = torch.arange(H, device=v.device, dtype=sx.dtype)[:, None]  # output row i, against K
    # x stage (along each row), all components in one matmul: [B, heads, i', (j, k), j'] @ [B, heads, i', j', d]
    # (bmm on 3-D views: torch.matmul would copy the 5-D kernels first)
    gx = _GaussianRowsFn.apply(sx, mx, cols, W)
    t = torch.bmm(gx.to(v.dtype).reshape(B * heads * H, n * K, W), v.reshape(B * heads * H, W, d))
    t = t.reshape(B, heads, H, n, K, d).permute(0, 1, 3, 4, 2, 5).reshape(B * heads * n, K * H, d)
    # y stage (along each column): components and rows contracted together, (k, i')
    gy = _GaussianRowsFn.apply(sy, my, rows, H, mix)  # [B, heads, j, i, K, i']
    return torch.bmm(gy.to(v.dtype).reshape(B * heads * n, H, K * H), t).reshape(B, heads, n, H, d)


def _steered_mix(
        vp: torch.Tensor, log_sigma: torch.Tensor, offset: torch.Tensor, mix_logits: torch.Tensor,
        residuals: torch.Tensor, columns_per_chunk: Optional[int] = None,
) -> torch.Tensor:
    """The steered separable mixing of values ``vp`` [B, H, W, heads, d].

    ``residuals`` [B, H, W, heads, K, 5] (bounded, from the tokens) move each component's x offset and log-width
    at every position (i', j) of the x stage (mixing along rows), and its y offset, log-width and mixture logit at
    every query (i, j):  Y[i, j] = sum_k a_k(i, j) sum_i' G^y_{k,(i,j)}[i'] sum_j' G^x_{k,(i',j)}[j'] V[i', j'].
    Each stage is a per-position 1-D Gaussian, so the work stays O(N (H + W) K C) and no N x N matrix is formed.

    It runs head-major in chunks of ``columns_per_chunk`` output columns (``_steered_columns``), so what one chunk
    creates is freed before the next; the default, head_dim // K, makes a chunk's kernels about the size of the
    values.
    """
    B, H, W, heads, d = vp.shape
    K = log_sigma.shape[-1]
    r = residuals.permute(0, 3, 1, 2, 4, 5)  # [B, heads, H, W, K, 5]
    log_sigma, offset = log_sigma[:, :, None, None], offset[:, :, None, None]  # [2, heads, 1, 1, K]
    sx, mx = log_sigma[1] + r[..., 1], offset[1] + r[..., 0]
    sy, my = log_sigma[0] + r[..., 3], offset[0] + r[..., 2]
    mix = (mix_logits[:, None, None] + r[..., 4]).softmax(dim=-1)
    # the y stage reads each query's parameters column-major: [B, heads, W, H, K]
    sy, my, mix = sy.transpose(2, 3), my.transpose(2, 3), mix.transpose(2, 3)
    v = vp.permute(0, 3, 1, 2, 4).contiguous()  # [B, heads, H, W, d], once for every chunk
    step = columns_per_chunk or max(1, d // K)
    out = []
    for j0 in range(0, W, step):
        j1 = min(W, j0 + step)
        # contiguous parameters: elementwise results take their layout, and the kernels must be plain for bmm
        params = [q.contiguous() for q in (sx[:, :, :, j0:j1], mx[:, :, :, j0:j1], sy[:, :, j0:j1], my[:, :, j0:j1],
                                           mix[:, :, j0:j1])]
        out.append(_steered_columns(v, *params, j0))
    return torch.cat(out, dim=2).permute(0, 3, 2, 1, 4)  # [B, H, W, heads, d]


def _steer_residuals(x: torch.Tensor, steer_weight: torch.Tensor, steer_gate: torch.Tensor,
                     grid_size: Tuple[int, int], heads: int, num_gaussians: int) -> torch.Tensor:
    """Bounded residuals [B, H, W, heads, K, 5] of the patch tokens, the last H * W of ``x`` [B, N, C]:
    bound * tanh(softplus(gate) * probe(x)) for x offset, x log-width, y offset, y log-width, mixture logit."""
    B = x.shape[0]
    H, W = grid_size
    # tokens sliced after the probe, not before: a sliced input would be copied by every matmul that reads it
    r = F.linear(x, steer_weight)[:, -H * W:].reshape(B, H, W, heads, num_gaussians, STEER_FIELDS)
    r = torch.tanh(F.softplus(steer_gate).to(r.dtype) * r)
    # Python scalars, field by field: a tensor of the bounds made here would be a host-to-device copy each forward,
    # which waits for the GPU (found by tests/test_cuda.py on an H200)
    return torch.cat([r[..., i:i + 1] * bound for i, bound in enumerate(STEER_BOUNDS)], dim=-1)


def _steered_heads(
        x: torch.Tensor, v_weight: torch.Tensor, v_bias: Optional[torch.Tensor], steer_weight: torch.Tensor,
        steer_gate: torch.Tensor, log_sigma: torch.Tensor, offset: torch.Tensor, mix_logits: torch.Tensor,
        grid_size: Tuple[int, int], columns_per_chunk: Optional[int] = None,
) -> torch.Tensor:
    """Heads of the steered mixer, from the tokens ``x`` [B, N, C] (prefix tokens, then the H * W patch tokens)
    to the patches' mixed values [B, H, W, heads, d], given those heads' rows of the value projection and probe
    and their kernel parameters (``log_sigma`` [2, heads, K] and the rest, as the mixer's).

    Values and residuals are made here, not passed in, so that a checkpoint of this function keeps nothing but the
    tokens (which the block keeps anyway) and recomputes its heads in backward."""
    B = x.shape[0]
    H, W = grid_size
    heads, K = log_sigma.shape[1:]
    v = F.linear(x, v_weight, v_bias)[:, -H * W:].reshape(B, H, W, heads, -1)
    res = _steer_residuals(x, steer_weight, steer_gate, grid_size, heads, K)
    if res.dtype in (torch.float16, torch.bfloat16):
        res = res.float()  # kernels in fp32 under autocast, as the fixed path builds them from fp32 parameters
    return _steered_mix(v, log_sigma, offset, mix_logits, res, columns_per_chunk=columns_per_chunk)


# how the fixed kernels are applied: 'operator', the N x N token matrix (one bmm); 'fused', the custom op
# separable_mix (two matmuls per head); 'triton', that op's one-pass Triton kernel (CUDA); 'accumulate', one component
# at a time, keeping nothing value-sized for backward; 'einsum', through a K-fold intermediate; 'auto' chooses
MIXING_PATHS = ('auto', 'operator', 'fused', 'triton', 'accumulate', 'einsum')
# (device type, patches at least, grad enabled) where a GPU run of benchmarks/gpu/mixer_check.py measured the Triton
# kernel correct and fastest: 'auto' takes it only there. None has run yet (docs/benchmark.md, "The GPU path").
TRITON_PROVEN: Tuple[Tuple[str, int, bool], ...] = ()
# the largest patch grid 'auto' mixes with the N x N operator (docs/benchmark.md, "Mixing paths")
OPERATOR_MAX_PATCHES = 576


def choose_mixing_path(mixing: str, patches: int, grad_enabled: bool, device_type: str) -> str:
    """The mixing path of a call: an explicit ``mixing`` as it is; ``'auto'``: the N x N operator up to
    ``OPERATOR_MAX_PATCHES`` patches (one bmm, measured faster there: docs/benchmark.md); above it the Triton kernel
    only where ``TRITON_PROVEN`` says a GPU run measured it correct and fastest; else the fused op's per-head matmuls
    for inference and the accumulate path for training (nothing value-sized kept for the backward, no K-fold
    intermediate), on every device."""
    if mixing != 'auto':
        return mixing
    if patches <= OPERATOR_MAX_PATCHES:
        return 'operator'
    if HAS_TRITON and any(device_type == d and patches >= n and grad_enabled == g for d, n, g in TRITON_PROVEN):
        return 'triton'
    return 'accumulate' if grad_enabled else 'fused'


class SeparableGaussianMixer(nn.Module):
    """Separable sum-of-Gaussians token mixer (SSoG; our reading of the paper, see the README).

    Per head h, values V_h = X W_v laid out on the H x W patch grid are mixed as
    ``Y_h = sum_k a_{h,k} G^y_{h,k} V_h (G^x_{h,k})^T`` with row-normalized Gaussian matrices whose widths (and,
    optionally, offsets) are learned in patch units, so one set of weights serves any grid. The two axes are two
    small matmuls, O(N (H + W) C) work; the N x N token matrix is never formed. Mixture weights a_{h,.} are a
    softmax, so each head's operator is an average and the mixer's Lipschitz constant has a cheap bound.

    Prefix tokens (CLS, registers) do not take part in the grid mixing: with ``prefix_mixing='mean'`` they
    receive the mean of the patch values, with ``'none'`` nothing (the MLP alone moves them).
    """
    supports_attn_maps = False

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            num_gaussians: int = 4,
            bias: bool = False,
            learn_offset: bool = False,
            prefix_mixing: str = 'mean',
            init_sigmas: Tuple[float, float] = (0.5, 8.0),
            recompute_mixing: bool = True,
            mixing: str = 'auto',
            steer: bool = False,
            proj_drop: float = 0.,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if dim % num_heads:
            raise ValueError(f'dim ({dim}) must be divisible by num_heads ({num_heads}).')
        if num_gaussians < 1:
            raise ValueError(f'num_gaussians must be >= 1, got {num_gaussians}.')
        if prefix_mixing not in ('mean', 'none'):
            raise ValueError(f"prefix_mixing must be 'mean' or 'none', got {prefix_mixing!r}.")
        if mixing not in MIXING_PATHS:
            raise ValueError(f'mixing must be one of {MIXING_PATHS}, got {mixing!r}.')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.num_gaussians = num_gaussians
        self.prefix_mixing = prefix_mixing
        self.init_sigmas = init_sigmas
        self.within_checkpoint = False
        self.recompute_mixing = recompute_mixing  # einsum and steered paths: accumulate always recomputes
        # how the fixed kernels are applied: MIXING_PATHS, 'auto' choosing by grid, batch and grad mode (mixing_path)
        self.mixing = mixing
        self._constants_cache: Optional[Tuple[tuple, MixingConstants]] = None
        self.v = nn.Linear(dim, dim, bias=bias, **dd)
        self.proj = nn.Linear(dim, dim, bias=bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        # separate sigma per axis: images are not isotropic in what they need to mix
        self.log_sigma = nn.Parameter(torch.empty(2, num_heads, num_gaussians, **dd))
        offset = torch.zeros(2, num_heads, num_gaussians, **dd)
        if learn_offset:
            self.offset = nn.Parameter(offset)
        else:
            # a buffer, not a frozen Parameter: every Parameter of a timm model is expected to train
            self.register_buffer('offset', offset)
        self.mix_logits = nn.Parameter(torch.zeros(num_heads, num_gaussians, **dd))
        self.steer = steer
        if steer:
            # a plain Parameter, not an nn.Linear, so that the model's Linear init leaves the probe at zero: at
            # initialisation the steered mixer is the fixed one exactly
            self.steer_weight = nn.Parameter(torch.zeros(num_heads * num_gaussians * STEER_FIELDS, dim, **dd))
            self.steer_gate = nn.Parameter(torch.zeros(STEER_FIELDS, **dd))
        self.reset_kernel_parameters()

    def reset_kernel_parameters(self) -> None:
        """Spread the initial widths geometrically from local to near-global, equal mixture weights."""
        if self.log_sigma.is_meta:
            return
        lo, hi = self.init_sigmas
        sig = torch.logspace(math.log10(lo), math.log10(hi), self.num_gaussians, dtype=torch.float32)
        with torch.no_grad():
            self.log_sigma.copy_(sig.log().to(self.log_sigma).expand_as(self.log_sigma))
            self.offset.zero_()
            self.mix_logits.zero_()
            if self.steer:
                self.steer_weight.zero_()
                self.steer_gate.fill_(-8.)  # softplus(-8) = 3e-4: the steering opens as it learns

    def kernels(self, grid_size: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(G^y [heads, K, H, H], G^x [heads, K, W, W], mixture weights [heads, K]) for a grid (``kernel_factors``)."""
        band_y, rows_y, band_x, rows_x, log_mix = self.kernel_factors(grid_size)
        return kernel_from_log_factors(band_y, rows_y), kernel_from_log_factors(band_x, rows_x), log_mix.exp()

    def kernel_factors(self, grid_size: Tuple[int, int]) -> Tuple[torch.Tensor, ...]:
        """The kernels' log-Toeplitz factors (band_y, rows_y, band_x, rows_x; ``gaussian_log_factors``) and the log
        mixture weights [heads, K], built in float32 (float64 for a float64 mixer) whatever the parameters' dtype."""
        dtype = _build_dtype(self.log_sigma.dtype)
        sigma, offset = self.log_sigma.to(dtype).exp(), self.offset.to(dtype)
        return (*gaussian_log_factors(grid_size[0], sigma[0], offset[0]),
                *gaussian_log_factors(grid_size[1], sigma[1], offset[1]), self.mix_logits.to(dtype).log_softmax(-1))

    def mixing_path(self, grid_size: Tuple[int, int], batch_size: int) -> str:
        """The path a call on this grid and batch takes (the batch does not change it today): ``choose_mixing_path``
        for this mixer's device."""
        return choose_mixing_path(self.mixing, grid_size[0] * grid_size[1], torch.is_grad_enabled(),
                                  self.v.weight.device.type)

    def field_constants(
            self, grid_size: Tuple[int, int], shape: Optional[Sequence[int]] = None,
    ) -> Dict[str, MixingConstants]:
        """The mixing's constants for a grid and states of ``shape`` [B, N, C] (default: one image, no prefix), ready
        in the mixing dtype: {'kernels': MixingConstants}. A depth integrator asks once per forward; without
        autograd (inference) they are also kept until a kernel parameter, the grid or the dtype changes, so an
        unchanged model builds them once, not once per forward (as timm's LeViT keeps its attention biases)."""
        if self.steer:
            return {}
        B, N = (1, grid_size[0] * grid_size[1]) if shape is None else shape[:2]
        path = self.mixing_path(grid_size, B)
        num_prefix = N - grid_size[0] * grid_size[1] if path == 'operator' else 0
        dtype = _mixing_dtype(self.v.weight)
        cache = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        if cache:
            params = (self.log_sigma, self.offset, self.mix_logits)
            key = (path, tuple(grid_size), num_prefix, dtype, self.prefix_mixing,
                   tuple((p.device, p.data_ptr(), p._version) for p in params))
            if self._constants_cache is not None and self._constants_cache[0] == key:
                return {'kernels': self._constants_cache[1]}
        mean = self.prefix_mixing == 'mean'
        device_type = self.log_sigma.device.type
        no_autocast = torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) \
            else contextlib.nullcontext()
        with no_autocast:  # built in float32, cast once at the end
            if path == 'operator':
                tensors = (_flush(_token_operator_t(*self.kernels(grid_size), num_prefix, mean), dtype),)
            else:
                band_y, rows_y, band_x, rows_x, log_mix = self.kernel_factors(grid_size)
                factors = (band_y, rows_y + log_mix[..., None], band_x, rows_x)  # G^y weighted by the mixture
                # fused: the O(n) float32 factors, expanded per head where used; the others: the kernels, cut, cast
                tensors = factors if path in ('fused', 'triton') else tuple(
                    kernel_from_log_factors(*factors[i:i + 2]).to(dtype) for i in (0, 2))
        constants = MixingConstants(path, tensors)
        if cache:
            self._constants_cache = (key, constants)
        return {'kernels': constants}

    def _recomputes_in_backward(self) -> bool:
        """Whether this call's mixing is checkpointed by the mixer itself: a backward will follow, recomputing is
        on, and no block checkpoint around it already recomputes the whole block."""
        return torch.is_grad_enabled() and self.recompute_mixing and not self.within_checkpoint

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Told by the depth integrator that it checkpoints whole blocks: the einsum path's own recompute would
        nest a second checkpoint inside that one and run the mixing three times, so it stands down."""
        self.within_checkpoint = enable

    def train(self, mode: bool = True) -> 'SeparableGaussianMixer':
        self._constants_cache = None
        return super().train(mode)

    def forward(
            self,
            x: torch.Tensor,
            grid_size: Optional[Tuple[int, int]] = None,
            return_attn: bool = False,
            kernels: Optional[MixingConstants] = None,
    ) -> torch.Tensor:
        """Mix ``x`` [B, N, C] on its patch grid; ``kernels`` are ``field_constants(grid_size, x.shape)``'s, when a
        depth integrator computed them once for all its evaluations of this mixer."""
        if return_attn:
            raise RuntimeError(
                'SeparableGaussianMixer forms no attention map; use dense_operator(grid_size) for its N x N '
                'equivalent on small grids, or a dense-attention model for attention-map losses.')
        if grid_size is None:
            raise ValueError('SeparableGaussianMixer needs the patch grid size (H, W) of the tokens.')
        B, N, C = x.shape
        H, W = grid_size
        num_prefix = N - H * W
        if num_prefix < 0:
            raise ValueError(f'{N} tokens cannot hold a {H}x{W} patch grid.')
        if self.steer:
            # the mean of the patch values without the values (each head makes its own): the projection is affine
            return self._with_prefix(self._steered(x, H, W), num_prefix, lambda: F.linear(
                x[:, num_prefix:].mean(dim=1, keepdim=True), self.v.weight, self.v.bias))
        if kernels is None:
            kernels = self.field_constants(grid_size, x.shape)['kernels']
        path, tensors = kernels
        if path == 'operator':
            return self.proj_drop(_mix_operator(x, self.v, self.proj, *tensors))
        if path in ('fused', 'triton'):
            # off the Triton kernel the op reads channel-major values in place: the projection's [C, B * N], viewed
            v = self.v(x) if path == 'triton' else _projected_t(x, self.v).t().view(B, N, C)
            return self.proj_drop(self.proj(separable_mix(v, *tensors, H, W, self.prefix_mixing == 'mean',
                                                          use_triton=path == 'triton')))
        gy, gx = tensors
        v = self.v(x)
        vp = v[:, num_prefix:].reshape(B, H, W, self.num_heads, self.head_dim)
        if path == 'accumulate':
            # head-major [heads, H, B * d, W]: both axes become plain bmm, one component at a time
            p = _head_major(v, num_prefix, H, W, self.num_heads)
            y = _SeparableMixFn.apply(p, gx, gy, x, self.v.weight, self.v.bias, num_prefix, H, W)
            y = y.reshape(self.num_heads, H, B, self.head_dim, W).permute(2, 1, 4, 0, 3)
        elif self._recomputes_in_backward():
            # the x-axis result is K times the values: recompute it in backward instead of keeping it
            y = checkpoint(einsum_mix, vp, gx, gy, use_reentrant=False)
        else:
            y = einsum_mix(vp, gx, gy)
        y = y.reshape(B, H * W, C)
        return self._with_prefix(y, num_prefix, lambda: v[:, num_prefix:].mean(dim=1, keepdim=True))

    def _with_prefix(self, y: torch.Tensor, num_prefix: int, patch_mean: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Prepend what the prefix tokens receive (``patch_mean()``, the mean of the patch values [B, 1, C], or
        nothing), then project."""
        B, _, C = y.shape
        if num_prefix:
            if self.prefix_mixing == 'mean':
                prefix = patch_mean().to(y.dtype).expand(B, num_prefix, C)
            else:
                prefix = y.new_zeros(B, num_prefix, C)
            y = torch.cat([prefix, y], dim=1)
        return self.proj_drop(self.proj(y))

    def steer_residuals(self, x: torch.Tensor, grid_size: Tuple[int, int]) -> torch.Tensor:
        """Bounded per-position residuals [B, H, W, heads, K, 5] read from the patch tokens, the last H * W of ``x``
        (zero when not steered):
        bound * tanh(softplus(gate) * probe(x)) for x offset, x log-width, y offset, y log-width, mixture logit."""
        return _steer_residuals(x, self.steer_weight, self.steer_gate, grid_size, self.num_heads, self.num_gaussians)

    def _steered(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        """Steered mixing. Without a backward to prepare, all heads at once; in training one head at a time, each
        checkpointed from the tokens, so the values, residuals and kernels of a head exist only while that head
        runs (forward or backward); the training peak is the fixed mixer's (docs/benchmark.md)."""
        B, _, C = x.shape
        if not self._recomputes_in_backward():
            y = _steered_heads(x, self.v.weight, self.v.bias, self.steer_weight, self.steer_gate,
                               self.log_sigma, self.offset, self.mix_logits, (H, W))
            return y.reshape(B, H * W, C)
        d, kf = self.head_dim, self.num_gaussians * STEER_FIELDS
        bias = self.v.bias
        heads = []
        for h in range(self.num_heads):
            # all W columns in one chunk: the head's backward keeps all its kernels anyway, so chunks would only add
            # matmuls (4% of a training step at 1024 px)
            args = (x, self.v.weight[h * d:(h + 1) * d], None if bias is None else bias[h * d:(h + 1) * d],
                    self.steer_weight[h * kf:(h + 1) * kf], self.steer_gate, self.log_sigma[:, h:h + 1],
                    self.offset[:, h:h + 1], self.mix_logits[h:h + 1], (H, W), W)
            heads.append(checkpoint(_steered_heads, *args, use_reentrant=False))
        return torch.cat(heads, dim=3).reshape(B, H * W, C)

    def dense_operator(self, grid_size: Tuple[int, int]) -> torch.Tensor:
        """The [heads, H*W, H*W] token-mixing matrix this mixer applies to the patch values (for small grids)."""
        if self.steer:
            raise TypeError('A steered mixer has no fixed operator: its kernels depend on the tokens.')
        return _grid_operator(*self.kernels(grid_size))

    @torch.no_grad()
    def lipschitz_bound(self, grid_size: Tuple[int, int], num_prefix_tokens: int = 0) -> torch.Tensor:
        """Upper bound of the mixer's Lipschitz constant (l2 over all tokens) for the current kernels.

        Each head's grid operator sum_k a_k (G^y_k kron G^x_k) has spectral norm at most
        sum_k a_k ||G^y_k|| ||G^x_k||, with ||G|| <= sqrt(||G||_1 ||G||_inf) = sqrt(max column sum) since rows sum
        to one. Prefix rows (the patch mean, norm 1/sqrt(N)) stack on top: sqrt(p / N + ||grid op||^2). Heads are
        block-diagonal (max over heads); the value and output projections multiply in their spectral norms.
        """
        if self.steer:
            raise TypeError(
                'A steered SeparableGaussianMixer has no global Lipschitz bound: its kernels depend on the tokens '
                '(the bound of the paper holds with fixed kernels). Build the model with ssog_steer=False (the layer: '
                'steer=False) for a bound.')
        gy, gx, mix = self.kernels(grid_size)
        norm_y = gy.sum(dim=-2).amax(dim=-1).sqrt()
        norm_x = gx.sum(dim=-2).amax(dim=-1).sqrt()
        grid_norm = (mix * norm_y * norm_x).sum(dim=-1).amax()
        n = grid_size[0] * grid_size[1]
        if num_prefix_tokens and self.prefix_mixing == 'mean':
            grid_norm = (num_prefix_tokens / n + grid_norm ** 2).sqrt()
        w_v = spectral_norm(self.v.weight)
        w_o = spectral_norm(self.proj.weight)
        return w_o * grid_norm.float() * w_v

    def extra_repr(self) -> str:
        return (f'num_heads={self.num_heads}, num_gaussians={self.num_gaussians}, prefix_mixing={self.prefix_mixing}'
                f', mixing={self.mixing}, steer={self.steer}')


class IdentityMixer(nn.Module):
    """No token mixing at all: the cost floor of everything else in a block (for benchmarks)."""
    supports_attn_maps = False

    def __init__(self, dim: int, num_heads: int = 1, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, grid_size: Optional[Tuple[int, int]] = None, return_attn: bool = False):
        if return_attn:
            raise RuntimeError('IdentityMixer forms no attention map: ask for maps from a model with '
                               'mixer="attention".')
        return x

    def lipschitz_bound(self, grid_size: Tuple[int, int], num_prefix_tokens: int = 0) -> torch.Tensor:
        return torch.ones(())


MIXERS = {
    'attention': MultiHeadAttention,
    'ssog': SeparableGaussianMixer,
    'identity': IdentityMixer,
}
# the options each mixer takes; a trunk passes the union and each mixer keeps its own
MIXER_OPTIONS = {
    'attention': ('attn_drop', 'proj_drop'),
    'ssog': ('num_gaussians', 'learn_offset', 'prefix_mixing', 'init_sigmas', 'recompute_mixing', 'mixing', 'steer',
             'proj_drop'),
    'identity': (),
}


def create_mixer(name: str, dim: int, num_heads: int, bias: bool, device=None, dtype=None, **kwargs) -> nn.Module:
    """Build a token mixer by name from the union of all mixers' options."""
    if name not in MIXERS:
        raise ValueError(f'Unknown token mixer {name!r}; choose one of {sorted(MIXERS)}.')
    options = {k: v for k, v in kwargs.items() if k in MIXER_OPTIONS[name]}
    return MIXERS[name](dim, num_heads=num_heads, bias=bias, device=device, dtype=dtype, **options)
