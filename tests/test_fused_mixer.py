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
from timm_odevit.layers.fused_mixer import HAS_TRITON, separable_mix, separable_mix_by_head, separable_mix_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# run in a child: TRITON_INTERPRET is read when a kernel is defined, at import, so it must be set before that
INTERPRETED_CHECK = textwrap.dedent('''
    import torch
    from timm_odevit.layers.fused_mixer import separable_mix_reference, separable_mix_triton

    TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # relative, of the output norm
    torch.manual_seed(0)
    # (batch, H, W, prefix tokens, heads, head dim, components, prefix mean): a patch-16 224 px grid, more prefix
    # tokens than a grid row, an odd head dim, batch 32
    cases = [(1, 14, 14, 1, 3, 64, 4, True), (1, 7, 3, 11, 2, 24, 2, False), (2, 4, 5, 0, 2, 16, 3, True),
             (32, 6, 5, 1, 2, 16, 4, True)]
    for B, H, W, P, heads, d, K, mean in cases:
        C = heads * d
        v = torch.randn(B, P + H * W, C, dtype=torch.float64)
        gy, gx = torch.rand(heads, K, H, H, dtype=torch.float64), torch.rand(heads, K, W, W, dtype=torch.float64)
        grad = torch.randn_like(v)
        for dtype, tol in TOLERANCE.items():
            args = [t.to(dtype) for t in (v, gy, gx)]
            ref = separable_mix_reference(*[t.double() for t in args], H, W, mean)
            out = separable_mix_triton(*args, H, W, mean)
            assert out.dtype == dtype and out.shape == v.shape
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < tol, (B, H, W, P, dtype, err)
            # the values' gradient, as the op's backward launches it: the mixing with transposed kernels
            g = grad.to(dtype)
            vr = args[0].double().requires_grad_()
            separable_mix_reference(vr, args[1].double(), args[2].double(), H, W, False).backward(g.double())
            back = separable_mix_triton(g, args[1].transpose(-1, -2), args[2].transpose(-1, -2), H, W, False)
            patches = vr.grad[:, P:]
            err = ((back[:, P:].double() - patches).norm() / patches.norm()).item()
            assert err < tol and not back[:, :P].any(), (B, H, W, P, dtype, 'backward', err)
    print('checked', len(cases) * len(TOLERANCE))
''')


@pytest.mark.skipif(not HAS_TRITON, reason='Triton is not installed')
def test_triton_kernel_equals_reference_under_the_interpreter():
    """Forward and the backward's transposed mixing, float32 / bfloat16 / float16, several grids, batch 1 and 32."""
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
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
        v = torch.randn(B, P + H * W, heads * d, dtype=torch.float64)
        gy, gx = torch.rand(heads, K, H, H, dtype=torch.float64), torch.rand(heads, K, W, W, dtype=torch.float64)
        args = [t.to(dtype) for t in (v, gy, gx)]
        if channel_major:
            args[0] = args[0].permute(2, 0, 1).contiguous().permute(1, 2, 0)
        ref = separable_mix_reference(*[t.double() for t in args], H, W, mean)
        out = separable_mix(*args, H, W, mean)
        assert out.dtype == dtype and out.stride() == args[0].stride()
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol, (B, H, W, P, dtype)
        torch.testing.assert_close(separable_mix_by_head(*args, H, W, mean), out, rtol=0, atol=0)
        g = torch.randn_like(args[0])
        back = separable_mix(g, args[1].transpose(-1, -2), args[2].transpose(-1, -2), H, W, False)
        vr = args[0].double().requires_grad_()
        separable_mix_reference(vr, args[1].double(), args[2].double(), H, W, False).backward(g.double())
        assert ((back[:, P:].double() - vr.grad[:, P:]).norm() / vr.grad[:, P:].norm()).item() < tol


@pytest.mark.parametrize('num_prefix,mean', [(0, True), (2, True), (3, False)])
def test_op_autograd_fake_and_registration(num_prefix, mean):
    """torch.library's own checks of the op (schema, fake tensor, autograd registration, compile), and its
    backward against finite differences."""
    torch.manual_seed(0)
    H, W, heads, K = 3, 4, 2, 2
    v = torch.randn(2, num_prefix + H * W, heads * 3, dtype=torch.float64, requires_grad=True)
    gy = torch.rand(heads, K, H, H, dtype=torch.float64, requires_grad=True)
    gx = torch.rand(heads, K, W, W, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(separable_mix, (v, gy, gx, H, W, mean))
    assert torch.autograd.gradcheck(lambda *a: separable_mix(*a, H, W, mean), (v, gy, gx))


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
    torch.testing.assert_close(mixer.log_sigma.grad, ref.log_sigma.grad)
    mixer.eval()
    with torch.no_grad():
        constants = mixer.field_constants((4, 5), x.shape)['kernels']
        with OpCounter() as counter:
            mixer(x, (4, 5), kernels=constants)
    assert counter.count == 3
