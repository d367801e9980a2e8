"""The separable Gaussian mixing as one fused GPU kernel (Triton), registered as the custom op
``torch.ops.timm_odevit.separable_mix``.

``separable_mix(v, gy, gx, height, width, mean_prefix)`` takes the projected values ``v`` [B, N, C] (prefix tokens,
then the H x W patches in row-major order), the pre-weighted kernels ``gy`` [heads, K, H, H] (a_k G^y_k) and ``gx``
[heads, K, W, W], and returns [B, N, C]: every patch mixed as ``sum_k a_k G^y_k V G^x_k^T`` per head, every prefix
token the mean of the patch values (``mean_prefix``) or zero. One op, one kernel launch on CUDA: all components and
both axes in one pass over the values, the prefix rows written by the same launch. Elsewhere (the CPU) the op runs
``separable_mix_by_head``: two matmuls and a copy per head, no K-fold intermediate of all heads, no kernel copied
over channels. ``separable_mix_reference`` (einsum) is what both are checked against. The backward is the same
mixing with transposed kernels for the values and two einsums for the kernels. ``torch.compile(fullgraph=True)``
and ``torch.export`` see one op through its fake implementation.

The kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors too, which is how the tests check it without a GPU.
"""
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

__all__ = ['separable_mix', 'separable_mix_by_head', 'separable_mix_reference', 'separable_mix_triton', 'einsum_mix',
           'HAS_TRITON']


def einsum_mix(vp: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """sum_k G^y_k V G^x_k^T per head: values [B, H, W, heads, d], kernels [heads, K, n, n] (G^y pre-weighted).

    One pair of contractions for all K components at once, through a K-fold intermediate [B, heads, K, H, W, d]:
    the reference every other path is checked against (and the mixer's 'einsum' path)."""
    # x axis, then y axis with the mixture sum folded into the same contraction over (k, row)
    return torch.einsum('hkuy,bhkyvd->buvhd', gy, _mix_columns(vp, gx))


def _mix_columns(vp: torch.Tensor, gx: torch.Tensor) -> torch.Tensor:
    """Every component's x-axis mixing, [B, heads, K, H, W, d]."""
    return torch.einsum('hkvw,bywhd->bhkyvd', gx, vp)


def separable_mix_reference(v: torch.Tensor, gy: torch.Tensor, gx: torch.Tensor, height: int, width: int,
                            mean_prefix: bool) -> torch.Tensor:
    """The mixing in plain PyTorch (``einsum_mix``), prefix rows included: what the fused kernel must equal."""
    B, N, C = v.shape
    heads = gy.shape[0]
    num_prefix = N - height * width
    vp = v[:, num_prefix:].reshape(B, height, width, heads, C // heads)
    y = einsum_mix(vp, gx, gy).reshape(B, height * width, C)
    if not num_prefix:
        return y
    prefix = v[:, num_prefix:].mean(dim=1, keepdim=True) if mean_prefix else v.new_zeros(B, 1, C)
    return torch.cat([prefix.to(y.dtype).expand(B, num_prefix, C), y], dim=1)


if HAS_TRITON:
    @triton.jit
    def _separable_mix_kernel(
            v_ptr, gy_ptr, gx_ptr, y_ptr, N, C, H, W, P, K, D, heads,
            MEAN_PREFIX: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BI: tl.constexpr,
            BW: tl.constexpr, BD: tl.constexpr,
    ):
        """Program (b, head, channel block) x (block of BI output rows, or the prefix program).

        Rows block: for each component k, each source row y is mixed along x once (G^x_k [W, W] @ V[y] [W, BD], a
        tensor-core dot) and added to every output row of the block with weight a_k G^y_k[i, y]. The prefix program
        averages the patch values and writes them to the P prefix rows (zeros without MEAN_PREFIX)."""
        pid = tl.program_id(0)
        row_block = tl.program_id(1)
        num_dblocks = tl.cdiv(D, BD)
        d = (pid % num_dblocks) * BD + tl.arange(0, BD)
        bh = pid // num_dblocks
        h = bh % heads
        b = bh // heads
        w = tl.arange(0, BW)
        dmask = d < D
        vw_mask = (w[:, None] < W) & dmask[None, :]
        v_base = v_ptr + b * N * C + P * C + h * D
        y_base = y_ptr + b * N * C + h * D
        if row_block == tl.cdiv(H, BI):
            total = tl.zeros([BW, BD], dtype=tl.float32)
            for src in range(0, H):
                total += tl.load(v_base + (src * W + w[:, None]) * C + d[None, :], mask=vw_mask, other=0.).to(
                    tl.float32)
            mean = tl.sum(total, axis=0) / (H * W)
            if not MEAN_PREFIX:
                mean = mean * 0.
            for p in range(0, P):
                tl.store(y_base + p * C + d, mean.to(y_ptr.dtype.element_ty), mask=dmask)
        else:
            i = row_block * BI + tl.arange(0, BI)
            acc = tl.zeros([BI, BW, BD], dtype=tl.float32)
            g_mask = (w[:, None] < W) & (w[None, :] < W)
            for k in range(0, K):
                hk = h * K + k
                gxk = tl.load(gx_ptr + (hk * W + w[:, None]) * W + w[None, :], mask=g_mask, other=0.)
                for src in range(0, H):
                    vt = tl.load(v_base + (src * W + w[:, None]) * C + d[None, :], mask=vw_mask, other=0.)
                    if UPCAST:
                        t = tl.dot(gxk.to(tl.float32), vt.to(tl.float32), input_precision='ieee')
                    elif IEEE:
                        t = tl.dot(gxk, vt, input_precision='ieee')
                    else:
                        t = tl.dot(gxk, vt)
                    gyc = tl.load(gy_ptr + (hk * H + i) * H + src, mask=i < H, other=0.).to(tl.float32)
                    acc += gyc[:, None, None] * t[None, :, :]
            out = y_base + ((P + i[:, None, None] * W + w[None, :, None]) * C + d[None, None, :])
            mask = (i[:, None, None] < H) & (w[None, :, None] < W) & dmask[None, None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


# Triton's interpreter (TRITON_INTERPRET=1, the tests' CPU run) computes a bfloat16 dot wrongly (numpy has no
# bfloat16): there the operands go to float32 first, which gives what the GPU's bfloat16 dot with float32
# accumulation gives (products of bfloat16 values are exact in float32)
_INTERPRETED = os.environ.get('TRITON_INTERPRET') == '1'


def _next_pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def separable_mix_triton(v: torch.Tensor, gy: torch.Tensor, gx: torch.Tensor, height: int, width: int,
                         mean_prefix: bool, block_rows: Optional[int] = None,
                         block_channels: Optional[int] = None) -> torch.Tensor:
    """Launch the fused kernel (on CUDA, or on the CPU under ``TRITON_INTERPRET=1``). Block sizes: 16 output rows
    and up to 32 channels per program by default (powers of two, at least 16 for the tensor-core dot); a GPU's
    best choice is measured by ``benchmarks/gpu/``."""
    if not HAS_TRITON:
        raise RuntimeError('The fused SSoG mixer needs Triton (pip install triton); ssog_mixing="separable" or '
                           '"accumulate" run without it.')
    B, N, C = v.shape
    heads, K = gy.shape[:2]
    D = C // heads
    out = torch.empty_like(v)  # the values' layout, as the fake implementation promises
    v, gy, gx = v.contiguous(), gy.contiguous().to(v.dtype), gx.contiguous().to(v.dtype)
    y = out if out.is_contiguous() else torch.empty_like(v)
    bi = block_rows or 16
    bd = block_channels or min(32, _next_pow2(D))
    grid = (B * heads * triton.cdiv(D, bd), triton.cdiv(height, bi) + 1)
    _separable_mix_kernel[grid](
        v, gy, gx, y, N, C, height, width, N - height * width, K, D, heads,
        MEAN_PREFIX=mean_prefix, IEEE=v.dtype == torch.float32, UPCAST=_INTERPRETED and v.dtype == torch.bfloat16,
        BI=bi, BW=_next_pow2(width), BD=bd)
    return out if y is out else out.copy_(y)


def separable_mix_by_head(v: torch.Tensor, gy: torch.Tensor, gx: torch.Tensor, height: int, width: int,
                          mean_prefix: bool) -> torch.Tensor:
    """The op wherever no fused kernel runs (the CPU; CUDA without Triton), one head at a time: the x axis as one
    matmul into that head's K-fold result, then the y axis contracted over (row, component) by a matmul whose kernel
    is broadcast over the head's channels (a stride-0 batch, never copied). Nothing K-fold of all heads exists at
    once. Channel-major values (the mixer passes its projection's [C, B * N] result as a [B, N, C] view) are read in
    place; the result takes their layout."""
    B, N, C = v.shape
    heads, K, H, W = gy.shape[0], gy.shape[1], height, width
    d, P = C // heads, N - height * width
    vt = v.permute(2, 0, 1).contiguous()  # [C, B, N]: no copy for channel-major values
    out = torch.empty_like(v)
    ot = out.permute(2, 0, 1)
    for h in range(heads):
        ch = slice(h * d, (h + 1) * d)
        # rows (channel, image, row i), columns (k, j'): a plain matmul, 1.5x faster under bf16 than a bmm with a
        # broadcast kernel; it copies this head's patch values only where prefix tokens sit between them
        t = torch.mm(vt[ch, :, P:].reshape(d * B * H, W), gx[h].permute(2, 0, 1).reshape(W, K * W))
        gy_h = gy[h].permute(1, 2, 0).reshape(H, H * K).expand(d * B, H, H * K)  # [i, (i', k)]
        ot[ch, :, P:].copy_(torch.bmm(gy_h, t.view(d * B, H * K, W)).view(d, B, H * W))
        del t  # before the next head's: one head's K-fold result alive at a time
    if P:
        ot[:, :, :P] = vt[:, :, P:].mean(dim=-1, keepdim=True) if mean_prefix else 0.
    return out


@torch.library.custom_op('timm_odevit::separable_mix', mutates_args=())
def separable_mix(v: torch.Tensor, gy: torch.Tensor, gx: torch.Tensor, height: int, width: int,
                  mean_prefix: bool) -> torch.Tensor:
    """See the module docstring. This body serves every device without a kernel of its own."""
    return separable_mix_by_head(v, gy, gx, height, width, mean_prefix)


if HAS_TRITON:
    @separable_mix.register_kernel('cuda')
    def _separable_mix_cuda(v, gy, gx, height, width, mean_prefix):
        return separable_mix_triton(v, gy, gx, height, width, mean_prefix)


@separable_mix.register_fake
def _separable_mix_fake(v, gy, gx, height, width, mean_prefix):
    return torch.empty_like(v)  # the layout of the values, as the CPU kernel returns it


def _setup_context(ctx, inputs, output) -> None:
    v, gy, gx, height, width, mean_prefix = inputs
    ctx.save_for_backward(v, gy, gx)
    ctx.grid = (height, width, mean_prefix)


def _backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    """The mixing is linear in the values: their gradient is the same mixing with transposed kernels (the op
    itself, so the fused kernel on CUDA), plus each prefix row's gradient spread evenly over the patches when the
    prefix took their mean. The kernels' gradients contract the values with the output gradient, one axis mixed."""
    v, gy, gx = ctx.saved_tensors
    height, width, mean_prefix = ctx.grid
    B, N, C = v.shape
    heads = gy.shape[0]
    num_prefix = N - height * width
    grad = grad.contiguous().to(v.dtype)
    grad_v = grad_gy = grad_gx = None
    if ctx.needs_input_grad[0]:
        grad_v = separable_mix(grad, gy.transpose(-1, -2), gx.transpose(-1, -2), height, width, False)
        if num_prefix:
            spread = grad[:, :num_prefix].sum(dim=1, keepdim=True) / (height * width) if mean_prefix else 0.
            grad_v = torch.cat([torch.zeros_like(grad_v[:, :num_prefix]), grad_v[:, num_prefix:] + spread], dim=1)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        vp = v[:, num_prefix:].reshape(B, height, width, heads, C // heads)
        gp = grad[:, num_prefix:].reshape(B, height, width, heads, C // heads)
        if ctx.needs_input_grad[1]:
            # dG^y_k[i, i'] = sum over (b, j, d) of dY[i, j] (V G^x_k^T)[i', j]
            t = _mix_columns(vp, gx)
            grad_gy = torch.einsum('buvhd,bhkyvd->hkuy', gp, t).to(gy.dtype)
        if ctx.needs_input_grad[2]:
            # dG^x_k[j, j'] = sum over (b, i', d) of (G^y_k^T dY)[i', j] V[i', j']
            s = torch.einsum('hkuy,buvhd->bhkyvd', gy, gp)
            grad_gx = torch.einsum('bhkyvd,bywhd->hkvw', s, vp).to(gx.dtype)
    return grad_v, grad_gy, grad_gx, None, None, None


separable_mix.register_autograd(_backward, setup_context=_setup_context)
