"""The separable Gaussian mixing as one op, ``torch.ops.timm_odevit.separable_mix``.

``separable_mix(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose, use_triton)`` mixes the
values ``v`` [B, N, C] (prefix tokens, then the H x W patches row-major) as ``sum_k a_k G^y_k V G^x_k^T`` per head,
each prefix token receiving the patch mean or zero. The kernels come as log-Toeplitz factors
(``kernel_from_log_factors``), O(n) numbers per component where a kernel has n^2. ``separable_mix_by_head`` runs two
matmuls per head on every device; ``use_triton`` (CUDA) runs one Triton launch for all components and both axes,
an option until a GPU run measures it faster (``mixers.TRITON_PROVEN``). The backward is the same mixing with
transposed kernels; ``torch.compile(fullgraph=True)`` and ``torch.export`` see one op.
"""
import math
import os
from typing import Optional, Tuple

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # a CPU-only environment: the op runs its per-head kernel everywhere
    triton = tl = None
    HAS_TRITON = False

__all__ = ['separable_mix', 'separable_mix_by_head', 'separable_mix_triton', 'einsum_mix', 'kernel_from_log_factors',
           'negligible_weight', 'triton_launch_config', 'HAS_TRITON', 'TRITON_MAX_WIDTH']


def negligible_weight(dtype: torch.dtype) -> float:
    """The kernel weight below which an entry cannot change a sum holding a weight near 1 (tiny / eps, 1e-31 in
    float32). Gaussian tails underflow to subnormals, which CPUs compute 10-20x slower in ``exp`` and every matmul
    that reads them; SSoG cuts its kernels here in their build dtype (float32 or float64), never in float16, whose
    tiny / eps is 0.0625: most entries of a wide Gaussian lie below that."""
    finfo = torch.finfo(dtype)
    return finfo.tiny / finfo.eps


def kernel_from_log_factors(band: torch.Tensor, rows: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """Kernels [..., n, n] from log-Toeplitz factors ``band`` [..., 2n - 1], ``rows`` [..., n]: G[..., i, j] =
    exp(rows[i] + band[i - j + n - 1]), entries below ``negligible_weight`` zeroed (transposed with ``transpose``).
    Every row-normalised Gaussian is exactly this: ``band`` its logits, ``rows`` minus each row's log-sum-exp."""
    n = rows.shape[-1]
    # unfold: U[i, j'] = band[i + j'], a view; flipped, band[i + n - 1 - j]
    logits = band.unfold(-1, n, 1).flip(-1).add_(rows[..., None])
    g = logits.masked_fill_(logits < math.log(negligible_weight(logits.dtype)), -math.inf).exp_()
    return g.transpose(-1, -2) if transpose else g


def einsum_mix(vp: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """sum_k G^y_k V G^x_k^T per head: values [B, H, W, heads, d], kernels [heads, K, n, n] (G^y pre-weighted).

    One pair of contractions for all K components at once, through a K-fold intermediate [B, heads, K, H, W, d]:
    the reference every other path is checked against (and the mixer's 'einsum' path)."""
    # x axis, then y axis with the mixture sum folded into the same contraction over (k, row)
    return torch.einsum('hkuy,bhkyvd->buvhd', gy, _mix_columns(vp, gx))


def _mix_columns(vp: torch.Tensor, gx: torch.Tensor) -> torch.Tensor:
    """Every component's x-axis mixing, [B, heads, K, H, W, d]."""
    return torch.einsum('hkvw,bywhd->bhkyvd', gx, vp)


if HAS_TRITON:
    @triton.jit
    def _kernel_entries(band_ptr, rows_ptr, hk, out_idx, src_idx, n, TRANSPOSE: tl.constexpr,
                        LOG_NEGLIGIBLE: tl.constexpr):
        """G_hk[out, src] (G^T with TRANSPOSE), zero outside n x n: ``kernel_from_log_factors`` in float32."""
        if TRANSPOSE:  # G^T[out, src] = G[src, out]
            out_idx, src_idx = src_idx, out_idx
        row, m, mask = out_idx + 0 * src_idx, out_idx - src_idx + n - 1, (out_idx < n) & (src_idx < n)
        logit = tl.load(band_ptr + hk * (2 * n - 1) + m, mask=mask) + tl.load(rows_ptr + hk * n + row, mask=mask)
        return tl.where(mask & (logit >= LOG_NEGLIGIBLE), tl.exp(logit), 0.)

    @triton.jit
    def _dot(a, b, acc, dtype, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b on tensor cores: float16 operands, float32 values as three tf32 products (IEEE), bfloat16
        ones as one tf32 product (rounding the kernels and T to bfloat16 took the error past the tests' 8e-3)."""
        if dtype == tl.float16:
            return tl.dot(a.to(dtype), b.to(dtype), acc)
        a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            return tl.dot(a, b, acc, input_precision='tf32x3')
        if UPCAST:  # the interpreter multiplies float32: cut the operands to tf32 as the tensor cores read them
            a = (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            b = (b.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        return tl.dot(a, b, acc, input_precision='tf32')

    @triton.jit
    def _separable_mix_kernel(
            v_ptr, band_y_ptr, rows_y_ptr, band_x_ptr, rows_x_ptr, y_ptr, N, C, H, W, P, K, D, heads,
            MEAN_PREFIX: tl.constexpr, TRANSPOSE: tl.constexpr, LOG_NEGLIGIBLE: tl.constexpr, IEEE: tl.constexpr,
            UPCAST: tl.constexpr, BI: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
    ):
        """Program (b, head, channel block) x (BI output rows, or the prefix program: the patch mean, zeros without
        MEAN_PREFIX). Per component and 16 columns j', the y axis as dots G^y_k[BI, 16 rows] @ V[16 rows, (j', BD)]
        into T, then the x axis on those BI rows only: G^x_k[W, j'] @ T[j', (BI, BD)] into the result [W, (BI, BD)]."""
        pid, row_block = tl.program_id(0), tl.program_id(1)
        bh, d0 = pid // tl.cdiv(D, BD), pid % tl.cdiv(D, BD) * BD
        b, h = bh // heads, bh % heads
        w = tl.arange(0, BW)
        # 64-bit offsets: B * N * C reaches 2^31 at 2048 px and batch 32 for the small width
        v_base = v_ptr + b.to(tl.int64) * N * C + P * C + h * D + d0
        y_base = y_ptr + b.to(tl.int64) * N * C + h * D + d0
        if row_block == tl.cdiv(H, BI):
            d = tl.arange(0, BD)
            total = tl.zeros([BW, BD], dtype=tl.float32)
            if MEAN_PREFIX:  # zeros otherwise: V is not read, and an inf patch value cannot become a NaN (inf * 0)
                for src in range(0, H):
                    total += tl.load(v_base + (src * W + w[:, None]) * C + d[None, :],
                                     mask=(w[:, None] < W) & (d0 + d[None, :] < D), other=0.).to(tl.float32)
            for p in range(0, P):
                tl.store(y_base + p * C + d, (tl.sum(total, 0) / (H * W)).to(y_ptr.dtype.element_ty), mask=d0 + d < D)
        else:
            i, u = row_block * BI + tl.arange(0, BI), tl.arange(0, 16)
            cw, cd = tl.arange(0, 16 * BD) // BD, tl.arange(0, 16 * BD) % BD  # (column, channel) of 16 columns
            acc = tl.zeros([BW, BI * BD], dtype=tl.float32)
            for k in range(0, K):
                for w0 in range(0, W, 16):
                    t = tl.zeros([BI, 16 * BD], dtype=tl.float32)
                    for s0 in range(0, H, 16):
                        gy = _kernel_entries(band_y_ptr, rows_y_ptr, h * K + k, i[:, None], s0 + u[None, :], H,
                                             TRANSPOSE, LOG_NEGLIGIBLE)
                        vt = tl.load(v_base + ((s0 + u[:, None]) * W + w0 + cw[None, :]) * C + cd[None, :], other=0.,
                                     mask=(s0 + u[:, None] < H) & (w0 + cw[None, :] < W) & (d0 + cd[None, :] < D))
                        t = _dot(gy, vt, t, v_ptr.dtype.element_ty, IEEE, UPCAST)
                    gx = _kernel_entries(band_x_ptr, rows_x_ptr, h * K + k, w[:, None], w0 + u[None, :], W, TRANSPOSE,
                                         LOG_NEGLIGIBLE)
                    t = tl.reshape(tl.permute(tl.reshape(t, [BI, 16, BD]), [1, 0, 2]), [16, BI * BD])
                    acc = _dot(gx, t, acc, v_ptr.dtype.element_ty, IEEE, UPCAST)
            ri, rd = row_block * BI + tl.arange(0, BI * BD) // BD, tl.arange(0, BI * BD) % BD
            tl.store(y_base + ((P + ri[None, :] * W + w[:, None]) * C + rd[None, :]), acc.to(y_ptr.dtype.element_ty),
                     mask=(w[:, None] < W) & (ri[None, :] < H) & (d0 + rd[None, :] < D))


# Triton's interpreter (TRITON_INTERPRET=1, the tests' CPU run) multiplies float32 exactly: tf32 is cut by hand there
_INTERPRETED = os.environ.get('TRITON_INTERPRET') == '1'


def _next_pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def separable_mix_triton(v: torch.Tensor, band_y: torch.Tensor, rows_y: torch.Tensor, band_x: torch.Tensor,
                         rows_x: torch.Tensor, height: int, width: int, mean_prefix: bool,
                         transpose: bool = False) -> torch.Tensor:
    """Launch the fused kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1``) as ``triton_launch_config`` says."""
    if not HAS_TRITON:
        raise RuntimeError('The fused SSoG mixer needs Triton (pip install triton); ssog_mixing="accumulate" does not.')
    B, N, C = v.shape
    heads, K = band_y.shape[:2]
    D, out = C // heads, torch.empty_like(v)  # the values' layout, as the fake implementation promises
    v, factors = v.contiguous(), [t.contiguous().float() for t in (band_y, rows_y, band_x, rows_x)]
    y = out if out.is_contiguous() else torch.empty_like(v)
    if width > TRITON_MAX_WIDTH:
        raise ValueError(f'The Triton mixer takes grids up to {TRITON_MAX_WIDTH} patches wide (its x-axis block lives '
                         f'in registers), got {width}: use ssog_mixing="fused" (per-head matmuls) there.')
    config = triton_launch_config(width, C // heads, v.dtype, transpose)
    grid = (B * heads * triton.cdiv(D, config['BD']), triton.cdiv(height, config['BI']) + 1)
    _separable_mix_kernel[grid](
        v, *factors, y, N, C, height, width, N - height * width, K, D, heads,
        MEAN_PREFIX=mean_prefix, TRANSPOSE=transpose, LOG_NEGLIGIBLE=math.log(negligible_weight(torch.float32)),
        IEEE=v.dtype == torch.float32, UPCAST=_INTERPRETED and v.dtype == torch.bfloat16, **config)
    return out if y is out else out.copy_(y)


# the widest grid the Triton kernel takes: its blocks live in registers, and wider grids (2048 px) spill
TRITON_MAX_WIDTH = 64


def triton_launch_config(width: int, head_dim: int, dtype: torch.dtype, transpose: bool = False) -> dict:
    """Block sizes and warps of a launch, as ptxas compiles them without spills for sm_80 and sm_90
    (tests/test_triton_compile.py): 16 output rows, the row padded to a power of two, 8 warps, 32 channels (16 from
    64 patches wide), half that in float32. ``TIMM_ODEVIT_TRITON_BI`` / ``_BD`` / ``_WARPS`` override them."""
    bw = _next_pow2(width)
    bd = (16 if bw >= 64 else 32) // (2 if dtype == torch.float32 else 1)
    config = dict(BI=16, BW=bw, BD=min(bd, _next_pow2(head_dim)), num_warps=8)
    for key, env in (('BI', 'TIMM_ODEVIT_TRITON_BI'), ('BD', 'TIMM_ODEVIT_TRITON_BD'),
                     ('num_warps', 'TIMM_ODEVIT_TRITON_WARPS')):
        if os.environ.get(env):
            config[key] = int(os.environ[env])
    return config


def separable_mix_by_head(v: torch.Tensor, band_y: torch.Tensor, rows_y: torch.Tensor, band_x: torch.Tensor,
                          rows_x: torch.Tensor, height: int, width: int, mean_prefix: bool,
                          transpose: bool = False) -> torch.Tensor:
    """The op wherever no fused kernel runs (the CPU; CUDA without Triton), one head at a time: its kernels expanded,
    the x axis as one matmul into the head's K-fold result, the y axis contracted over (row, component) by a matmul
    whose kernel is broadcast over the head's channels (a stride-0 batch, never copied). Channel-major values (the
    mixer's projection's [C, B * N] as a [B, N, C] view) are read in place; the result takes their layout."""
    B, N, C = v.shape
    heads, K, H, W = band_y.shape[0], band_y.shape[1], height, width
    d, P = C // heads, N - height * width
    vt = v.permute(2, 0, 1).contiguous()  # [C, B, N]: no copy for channel-major values
    out = torch.empty_like(v)
    ot = out.permute(2, 0, 1)
    for h in range(heads):
        ch = slice(h * d, (h + 1) * d)
        gx = kernel_from_log_factors(band_x[h], rows_x[h], transpose).to(v.dtype)
        gy = kernel_from_log_factors(band_y[h], rows_y[h], transpose).to(v.dtype)
        # rows (channel, image, row i), columns (k, j'): a plain matmul, 1.5x faster under bf16 than a bmm with a
        # broadcast kernel; it copies this head's patch values only where prefix tokens sit between them
        t = torch.mm(vt[ch, :, P:].reshape(d * B * H, W), gx.permute(2, 0, 1).reshape(W, K * W))
        gy = gy.permute(1, 2, 0).reshape(H, H * K).expand(d * B, H, H * K)  # [i, (i', k)]
        ot[ch, :, P:].copy_(torch.bmm(gy, t.view(d * B, H * K, W)).view(d, B, H * W))
        del t  # before the next head's: one head's K-fold result alive at a time
    if P:
        ot[:, :, :P] = vt[:, :, P:].mean(dim=-1, keepdim=True) if mean_prefix else 0.
    return out


@torch.library.custom_op('timm_odevit::separable_mix', mutates_args=())
def separable_mix(v: torch.Tensor, band_y: torch.Tensor, rows_y: torch.Tensor, band_x: torch.Tensor,
                  rows_x: torch.Tensor, height: int, width: int, mean_prefix: bool,
                  transpose: bool = False, use_triton: bool = False) -> torch.Tensor:
    """See the module docstring. This body serves every device without a kernel of its own; ``use_triton`` asks for
    the Triton kernel, which runs on CUDA only."""
    if use_triton:
        raise ValueError(f'The Triton SSoG mixer runs on CUDA with Triton installed; these values are on '
                         f'{v.device.type}{"" if HAS_TRITON else " and Triton is missing"}: use ssog_mixing="fused".')
    return separable_mix_by_head(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose)


@separable_mix.register_kernel('cuda')
def _separable_mix_cuda(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose=False,
                        use_triton=False):
    if use_triton:
        return separable_mix_triton(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose)
    return separable_mix_by_head(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose)


@separable_mix.register_fake
def _separable_mix_fake(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose=False,
                        use_triton=False):
    return torch.empty_like(v)  # the layout of the values, as the CPU kernel returns it


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:5])  # the values and the four factors
    ctx.grid = inputs[5:]  # height, width, mean_prefix, transpose, use_triton


def _factor_gradients(grad_g: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(band, rows) gradients from a kernel's: G[i, j] = exp(rows[i] + band[i - j + n - 1]) passes dL/dG * G to both,
    summed along each diagonal for ``band``, along each row for ``rows``."""
    n, p = g.shape[-1], grad_g * g
    idx = torch.arange(n, device=g.device)
    diagonal = (idx[:, None] - idx[None, :] + n - 1).flatten()
    return p.new_zeros(*p.shape[:-2], 2 * n - 1).index_add_(-1, diagonal, p.flatten(-2)), p.sum(-1)


def _backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    """The mixing is linear in the values: their gradient is the op with transposed kernels, plus each prefix row's
    gradient spread over the patches when the prefix took their mean. The kernels' gradients contract the values with
    the output gradient, one axis mixed, and pass to the factors (``_factor_gradients``)."""
    v, band_y, rows_y, band_x, rows_x = ctx.saved_tensors
    height, width, mean_prefix, transpose, use_triton = ctx.grid
    (B, N, C), heads = v.shape, band_y.shape[0]
    num_prefix = N - height * width
    grad = grad.contiguous().to(v.dtype)
    grads = [None] * 10
    if ctx.needs_input_grad[0]:
        grad_v = separable_mix(grad, band_y, rows_y, band_x, rows_x, height, width, False, not transpose, use_triton)
        if num_prefix:
            spread = grad[:, :num_prefix].sum(dim=1, keepdim=True) / (height * width) if mean_prefix else 0.
            grad_v = torch.cat([torch.zeros_like(grad_v[:, :num_prefix]), grad_v[:, num_prefix:] + spread], dim=1)
        grads[0] = grad_v
    if any(ctx.needs_input_grad[1:5]):
        gy, gx = kernel_from_log_factors(band_y, rows_y), kernel_from_log_factors(band_x, rows_x)
        # the kernels the forward applied, in the values' dtype; their gradients are the transposed kernels' ones
        used_y, used_x = [(g.mT if transpose else g).to(v.dtype) for g in (gy, gx)]
        vp = v[:, num_prefix:].reshape(B, height, width, heads, C // heads)
        gp = grad[:, num_prefix:].reshape(B, height, width, heads, C // heads)
        # one head at a time: the K-fold intermediates of all heads at once were 400 MB each (1024 px, batch 32)
        grad_gy, grad_gx = torch.zeros_like(gy), torch.zeros_like(gx)
        for h in range(heads):
            vh, gh = vp[:, :, :, h:h + 1], gp[:, :, :, h:h + 1]
            if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                # dG^y_k[i, i'] = sum over (b, j, d) of dY[i, j] (V G^x_k^T)[i', j]
                grad_gy[h:h + 1] = torch.einsum('buvhd,bhkyvd->hkuy', gh, _mix_columns(vh, used_x[h:h + 1]))
            if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
                # dG^x_k[j, j'] = sum over (b, i', d) of (G^y_k^T dY)[i', j] V[i', j']
                s = torch.einsum('hkuy,buvhd->bhkyvd', used_y[h:h + 1], gh)
                grad_gx[h:h + 1] = torch.einsum('bhkyvd,bywhd->hkvw', s, vh)
                del s
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grads[1:3] = _factor_gradients(grad_gy.mT if transpose else grad_gy, gy)
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            grads[3:5] = _factor_gradients(grad_gx.mT if transpose else grad_gx, gx)
    return tuple(grads)


separable_mix.register_autograd(_backward, setup_context=_setup_context)
