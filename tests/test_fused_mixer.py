"""The fused SSoG mixer (torch.ops.timm_odevit.separable_mix): its Triton kernel against the reference on the CPU
under Triton's interpreter, its per-head kernel (every device without Triton) against the reference, its autograd
formula and fake implementation, and the op inside a compiled model."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from timm_odevit.layers import SeparableGaussianMixer
from timm_odevit.layers.fused_mixer import (HAS_TRITON, einsum_mix, kernel_from_log_factors, separable_mix,
                                            separable_mix_by_head)
from tiers import slow_except

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# run in a child: TRITON_INTERPRET is read when a kernel is defined, at import, so it must be set before that
INTERPRETED_CHECK = textwrap.dedent('''
    import torch
    from timm_odevit.layers.fused_mixer import separable_mix_triton
    from tests.test_fused_mixer import random_factors, separable_mix_reference

    TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # relative, of the output norm
    torch.manual_seed(0)
    # (batch, H, W, prefix tokens, heads, head dim, components, prefix mean): a patch-16 224 px grid, more prefix
    # tokens than a grid row, an odd head dim, batch 32
    cases = [(1, 14, 14, 1, 3, 64, 4, True), (1, 7, 3, 11, 2, 24, 2, False), (2, 4, 5, 0, 2, 16, 3, True),
             (32, 6, 5, 1, 2, 16, 4, True)]
    for B, H, W, P, heads, d, K, mean in cases:
        C = heads * d
        v = torch.randn(B, P + H * W, C, dtype=torch.float64)
        factors, gy, gx = random_factors(heads, K, H, W)
        grad = torch.randn_like(v)
        for dtype, tol in TOLERANCE.items():
            vd = v.to(dtype)
            ref = separable_mix_reference(vd.double(), gy, gx, H, W, mean)
            out = separable_mix_triton(vd, *factors, H, W, mean)
            assert out.dtype == dtype and out.shape == v.shape
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < tol, (B, H, W, P, dtype, err)
            # the values' gradient, as the op's backward launches it: the mixing with transposed kernels
            g = grad.to(dtype)
            vr = vd.double().requires_grad_()
            separable_mix_reference(vr, gy, gx, H, W, False).backward(g.double())
            back = separable_mix_triton(g, *factors, H, W, False, True)
            patches = vr.grad[:, P:]
            err = ((back[:, P:].double() - patches).norm() / patches.norm()).item()
            assert err < tol and not back[:, :P].any(), (B, H, W, P, dtype, 'backward', err)
    # prefix rows without the mean get zeros and the values are not read: an inf patch value leaves them zero, not NaN
    v = torch.randn(1, 3 + 4 * 5, 32)
    v[0, 7, 1] = float('inf')
    assert not separable_mix_triton(v, *random_factors(2, 2, 4, 5)[0], 4, 5, False)[:, :3].any()
    print('checked', len(cases) * len(TOLERANCE))
''')


def separable_mix_reference(v: torch.Tensor, gy: torch.Tensor, gx: torch.Tensor, height: int, width: int,
                            mean_prefix: bool) -> torch.Tensor:
    """The op in plain PyTorch from full kernels (the mixer's ``einsum_mix``), prefix rows included: what every
    kernel of the op must equal."""
    B, N, C = v.shape
    heads = gy.shape[0]
    num_prefix = N - height * width
    vp = v[:, num_prefix:].reshape(B, height, width, heads, C // heads)
    y = einsum_mix(vp, gx, gy).reshape(B, height * width, C)
    if not num_prefix:
        return y
    prefix = v[:, num_prefix:].mean(dim=1, keepdim=True) if mean_prefix else v.new_zeros(B, 1, C)
    return torch.cat([prefix.to(y.dtype).expand(B, num_prefix, C), y], dim=1)


def random_factors(heads: int, K: int, H: int, W: int, dtype: torch.dtype = torch.float32):
    """Log-Toeplitz factors (band_y, rows_y, band_x, rows_x) of random kernels, a fifth of every band below the
    negligible weight (the op zeroes those entries), and the float64 kernels they expand to."""
    factors = []
    for n in (H, W):
        band = -3 * torch.rand(heads, K, 2 * n - 1, dtype=dtype)  # weights in (0, 1], as a kernel's (float16's range)
        band[..., ::5] = -800.  # below float64's negligible weight too
        factors += [band, -torch.rand(heads, K, n, dtype=dtype)]
    gy, gx = kernel_from_log_factors(*[t.double() for t in factors[:2]]), kernel_from_log_factors(
        *[t.double() for t in factors[2:]])
    assert (gy == 0).any() and (gx == 0).any()
    return factors, gy, gx


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason='Triton is not installed')
def test_triton_kernel_equals_reference_under_the_interpreter():
    """Forward and the backward's transposed mixing, float32 / bfloat16 / float16, several grids, batch 1 and 32."""
    path = os.pathsep.join([ROOT, os.path.join(ROOT, 'tests'), os.environ.get('PYTHONPATH', '')])  # tiers too
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=path)
    proc = subprocess.run([sys.executable, '-c', INTERPRETED_CHECK], capture_output=True, text=True, env=env,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'checked 12' in proc.stdout


@pytest.mark.parametrize('dtype,tol', [(torch.float32, 1e-5), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
@pytest.mark.parametrize('channel_major', [False, True])
def test_per_head_kernel_equals_reference(dtype, tol, channel_major):
    """The op off CUDA: forward, and the values' gradient as the backward computes it (the op with transposed
    kernels), for values laid out token-major or channel-major (the mixer's: read in place, the result in their
    layout); several grids, prefix tokens (more than a grid row, none), batch 1 and 3."""
    torch.manual_seed(0)
    for B, H, W, P, heads, d, K, mean in [(1, 14, 14, 1, 3, 64, 4, True), (1, 7, 3, 11, 2, 24, 2, False),
                                          (3, 4, 5, 0, 2, 16, 3, True), (3, 6, 5, 2, 2, 16, 4, True)]:
        v = torch.randn(B, P + H * W, heads * d, dtype=torch.float64).to(dtype)
        factors, gy, gx = random_factors(heads, K, H, W)
        if channel_major:
            v = v.permute(2, 0, 1).contiguous().permute(1, 2, 0)
        ref = separable_mix_reference(v.double(), gy, gx, H, W, mean)
        out = separable_mix(v, *factors, H, W, mean)
        assert out.dtype == dtype and out.stride() == v.stride()
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol, (B, H, W, P, dtype)
        torch.testing.assert_close(separable_mix_by_head(v, *factors, H, W, mean), out, rtol=0, atol=0)
        g = torch.randn_like(v)
        back = separable_mix(g, *factors, H, W, False, True)
        vr = v.double().requires_grad_()
        separable_mix_reference(vr, gy, gx, H, W, False).backward(g.double())
        assert ((back[:, P:].double() - vr.grad[:, P:]).norm() / vr.grad[:, P:].norm()).item() < tol


@pytest.mark.parametrize('num_prefix,mean,transpose',
                         slow_except([(0, True, False), (2, True, True), (3, False, False)], fast=lambda c: c[0] == 3))
def test_op_autograd_fake_and_registration(num_prefix, mean, transpose):
    """torch.library's own checks of the op (schema, fake tensor, autograd registration, compile), and its
    backward against finite differences, for the values and the four kernel factors, kernels plain or transposed."""
    torch.manual_seed(0)
    H, W, heads, K = 3, 4, 2, 2
    v = torch.randn(2, num_prefix + H * W, heads * 3, dtype=torch.float64, requires_grad=True)
    factors = [t.requires_grad_() for t in random_factors(heads, K, H, W, torch.float64)[0]]
    torch.library.opcheck(separable_mix, (v, *factors, H, W, mean, transpose))
    assert torch.autograd.gradcheck(lambda *a: separable_mix(*a, H, W, mean, transpose), (v, *factors))


def test_kernel_factors_are_the_softmax_gaussians_and_all_the_fused_path_keeps():
    """The mixer's kernels, from their log-Toeplitz factors, equal row-wise softmaxes of the Gaussian logits computed
    here in float64, narrow, wide and with centres shifted far off the grid (rows that a shift leaves without their
    peak included), and the fused path's constants (G^y weighted by the mixture) expand to the same; those factors are
    all that a forward keeps for it: O(n) numbers per component, not the O(n^2) kernels."""
    torch.manual_seed(0)
    mixer = SeparableGaussianMixer(24, 3, num_gaussians=4, learn_offset=True, mixing='fused').eval()
    with torch.no_grad():
        mixer.log_sigma.copy_(torch.tensor([0.1, 0.5, 2., 9.]).log().expand(2, 3, 4))
        mixer.offset.normal_(0, 5.)
        mixer.mix_logits.normal_()
    H, W = 9, 13
    sigma, offset = mixer.log_sigma.detach().double().exp(), mixer.offset.double()
    expected = []
    for axis, n in enumerate((H, W)):
        i = torch.arange(n, dtype=torch.float64)
        centre = i[:, None] - offset[axis, ..., None, None]  # i - offset, against j
        logits = -(centre - i) ** 2 / (2 * sigma[axis, ..., None, None] ** 2)
        expected.append(logits.softmax(-1).float())
    mix = mixer.mix_logits.detach().softmax(-1)[..., None, None]
    with torch.no_grad():
        gy, gx, kernel_mix = mixer.kernels((H, W))
        constants = mixer.field_constants((H, W), (1, 1 + H * W, 24))['kernels']
    assert (offset.abs() > 4).any()  # centres shifted so far that some rows' peaks lie outside the grid
    for got, want in ((gy, expected[0]), (gx, expected[1]), (kernel_mix[..., None, None], mix)):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
    assert constants.path == 'fused'
    torch.testing.assert_close(kernel_from_log_factors(*constants.tensors[:2]), expected[0] * mix, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(kernel_from_log_factors(*constants.tensors[2:]), expected[1], atol=1e-7, rtol=1e-5)
    assert sum(t.numel() for t in constants.tensors) == 3 * 4 * (3 * H - 1 + 3 * W - 1)


def test_fused_path_compiles_into_one_graph_and_is_one_op():
    """The op traces through its fake implementation: one graph under torch.compile(fullgraph=True), and the mixer's
    forward issues three ops: the value projection, the op, the output projection."""
    from timm_odevit_tools.benchmark.runner import OpCounter
    torch.manual_seed(0)
    mixer = SeparableGaussianMixer(12, 3, learn_offset=True, mixing='fused')
    ref = SeparableGaussianMixer(12, 3, learn_offset=True, mixing='einsum')
    ref.load_state_dict(mixer.state_dict())
    x = torch.randn(2, 1 + 4 * 5, 12)
    compiled = torch.compile(mixer, fullgraph=True, backend='aot_eager')
    xi, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = compiled(xi, (4, 5))
    expected = ref(xr, (4, 5))
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(xi.grad, xr.grad)
    for name in ('log_sigma', 'offset', 'mix_logits'):
        torch.testing.assert_close(getattr(mixer, name).grad, getattr(ref, name).grad)
    mixer.eval()
    with torch.no_grad():
        constants = mixer.field_constants((4, 5), x.shape)['kernels']
        with OpCounter() as counter:
            mixer(x, (4, 5), kernels=constants)
    assert counter.count == 3
