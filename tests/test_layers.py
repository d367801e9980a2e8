"""Token mixers and CenterNorm against independent references."""
import math

import pytest
import torch

from timm_odevit.layers import CenterNorm, FieldBlock, MultiHeadAttention, SeparableGaussianMixer


def reference_gaussian_operator(mixer: SeparableGaussianMixer, H: int, W: int) -> torch.Tensor:
    """The [heads, N, N] patch-mixing matrix, built entry by entry from the definition."""
    sigma = mixer.log_sigma.detach().exp().double()
    offset = mixer.offset.detach().double()
    mix = mixer.mix_logits.detach().double().softmax(-1)
    heads, K = mix.shape

    def gauss(n, s, mu):
        g = torch.tensor([[math.exp(-(i - j - mu) ** 2 / (2 * s ** 2)) for j in range(n)] for i in range(n)],
                         dtype=torch.float64)
        return g / g.sum(dim=1, keepdim=True)

    op = torch.zeros(heads, H * W, H * W, dtype=torch.float64)
    for h in range(heads):
        for k in range(K):
            gy = gauss(H, float(sigma[0, h, k]), float(offset[0, h, k]))
            gx = gauss(W, float(sigma[1, h, k]), float(offset[1, h, k]))
            for a in range(H):
                for b in range(W):
                    for c in range(H):
                        for d in range(W):
                            op[h, a * W + b, c * W + d] += mix[h, k] * gy[a, c] * gx[b, d]
    return op


def _randomize_kernels(mixer: SeparableGaussianMixer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mixer.log_sigma.copy_(torch.randn(mixer.log_sigma.shape, generator=g) * 0.7)
        mixer.mix_logits.copy_(torch.randn(mixer.mix_logits.shape, generator=g))
        mixer.offset.copy_(torch.randn(mixer.offset.shape, generator=g))


@pytest.mark.parametrize('grid,num_prefix', [((3, 4), 1), ((4, 4), 0), ((5, 2), 3)])
def test_ssog_matches_dense_reference(grid, num_prefix):
    torch.manual_seed(0)
    H, W = grid
    dim, heads = 12, 3
    mixer = SeparableGaussianMixer(dim, heads, num_gaussians=3, bias=True, learn_offset=True).double()
    _randomize_kernels(mixer)
    x = torch.randn(2, num_prefix + H * W, dim, dtype=torch.float64)
    out = mixer(x, grid)

    v = mixer.v(x)
    vp = v[:, num_prefix:].reshape(2, H * W, heads, dim // heads)
    op = reference_gaussian_operator(mixer, H, W)
    mixed = torch.einsum('hnm,bmhd->bnhd', op, vp).reshape(2, H * W, dim)
    prefix = vp.mean(dim=1).reshape(2, 1, dim).expand(2, num_prefix, dim)
    expected = mixer.proj(torch.cat([prefix, mixed], dim=1))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(mixer.dense_operator(grid), op)


def test_ssog_prefix_none_and_any_grid():
    mixer = SeparableGaussianMixer(8, 2, prefix_mixing='none')
    for grid in [(2, 3), (7, 7), (1, 9)]:
        x = torch.randn(1, 1 + grid[0] * grid[1], 8)
        out = mixer(x, grid)
        assert out.shape == x.shape
        torch.testing.assert_close(out[:, 0], mixer.proj(torch.zeros(1, 8)))


@pytest.mark.parametrize('grid,num_prefix', [((3, 3), 1), ((4, 2), 0)])
def test_ssog_lipschitz_bound_above_operator_norm(grid, num_prefix):
    torch.manual_seed(1)
    mixer = SeparableGaussianMixer(8, 2, num_gaussians=3, bias=False, learn_offset=True).double()
    _randomize_kernels(mixer, seed=3)
    N = num_prefix + grid[0] * grid[1]
    # bias-free: the mixer is linear, its Jacobian is its operator and the spectral norm is exact
    jac = torch.autograd.functional.jacobian(lambda t: mixer(t.reshape(1, N, 8), grid).reshape(-1),
                                             torch.randn(N * 8, dtype=torch.float64))
    norm = torch.linalg.matrix_norm(jac, ord=2)
    bound = mixer.lipschitz_bound(grid, num_prefix)
    assert bound >= norm * (1 - 1e-9), (float(bound), float(norm))


@pytest.mark.parametrize('mixer', ['ssog', 'identity'])
def test_field_block_lipschitz_bound_above_local_norms(mixer):
    torch.manual_seed(2)
    block = FieldBlock(8, 2, mixer=mixer, mlp_ratio=2, mixer_kwargs=dict(learn_offset=True) if mixer == 'ssog' else {})
    block = block.double()
    if mixer == 'ssog':
        _randomize_kernels(block.mixer, seed=4)
    grid, N = (3, 3), 10
    bound = block.lipschitz_bound(grid, num_prefix_tokens=1)
    for _ in range(3):
        jac = torch.autograd.functional.jacobian(lambda t: block(t.reshape(1, N, 8), grid).reshape(-1),
                                                 torch.randn(N * 8, dtype=torch.float64) * 3)
        assert bound >= torch.linalg.matrix_norm(jac, ord=2)
    with pytest.raises(TypeError, match='Lipschitz'):
        FieldBlock(8, 2, mixer='attention').lipschitz_bound(grid)


def test_attention_fused_equals_explicit_and_returns_maps():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, bias=False).eval()
    assert attn.qkv.bias is None and attn.proj.bias is None
    x = torch.randn(2, 7, 16)
    fused = attn(x)
    explicit, maps = attn(x, return_attn=True)
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-6)
    assert maps.shape == (2, 4, 7, 7)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 4, 7))


def test_center_norm():
    norm = CenterNorm(6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2)
        norm.bias.normal_()
    x = torch.randn(4, 6) * 5 + 3
    y = norm(x)
    centred = (x - x.mean(-1, keepdim=True)) * 6 / 5
    torch.testing.assert_close(y, centred * norm.weight + norm.bias)
    # no variance division: scaling the input scales the output linearly (up to the bias)
    torch.testing.assert_close(norm(2 * x) - norm.bias, 2 * (y - norm.bias))
    jac = torch.autograd.functional.jacobian(norm, torch.randn(6))
    assert norm.lipschitz_bound() >= torch.linalg.matrix_norm(jac, ord=2) - 1e-6


def test_ssog_recompute_in_backward_gives_the_same_gradients():
    torch.manual_seed(3)
    x = torch.randn(2, 1 + 4 * 5, 12)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        mixer = SeparableGaussianMixer(12, 3, learn_offset=True, recompute_mixing=recompute)
        _randomize_kernels(mixer)
        xi = x.clone().requires_grad_()
        mixer(xi, (4, 5)).square().sum().backward()
        grads.append(torch.cat([xi.grad.flatten()] + [p.grad.flatten() for p in mixer.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def _mix_pair(grid, num_prefix, batch=2, dtype=torch.float64, mixing='accumulate', prefix_mixing='mean'):
    """The same mixer (random kernels, learned offsets) on a ``mixing`` path and on the einsum path."""
    torch.manual_seed(1)
    mixers = []
    for path in (mixing, 'einsum'):
        torch.manual_seed(0)
        m = SeparableGaussianMixer(12, 3, num_gaussians=3, bias=True, learn_offset=True, mixing=path,
                                   prefix_mixing=prefix_mixing).to(dtype)
        _randomize_kernels(m)
        mixers.append(m)
    x = torch.randn(batch, num_prefix + grid[0] * grid[1], 12, dtype=dtype)
    return mixers, x


@pytest.mark.parametrize('mixing', ['accumulate', 'operator', 'fused'])
@pytest.mark.parametrize('grid,num_prefix,batch,prefix_mixing', [
    ((4, 4), 0, 1, 'mean'), ((3, 5), 1, 2, 'mean'), ((6, 2), 3, 3, 'mean'), ((1, 7), 2, 2, 'mean'),
    ((2, 3), 7, 1, 'mean'), ((3, 2), 4, 1, 'none')])  # more prefix tokens than a grid row: two prefix rows
def test_ssog_mixing_paths_equal_einsum_path(mixing, grid, num_prefix, batch, prefix_mixing):
    mixers, x = _mix_pair(grid, num_prefix, batch, mixing=mixing, prefix_mixing=prefix_mixing)
    assert mixers[0].mixing_path(grid, batch) == mixing
    outs, grads = [], []
    g = torch.randn(batch, x.shape[1], 12, dtype=x.dtype)
    for m in mixers:
        xi = x.clone().requires_grad_()
        out = m(xi, grid)
        (out * g).sum().backward()
        outs.append(out)
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    torch.testing.assert_close(outs[0], outs[1])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # the kernel parameters do receive a gradient (a backward that dropped them would pass the value checks)
    assert mixers[0].log_sigma.grad.abs().sum() > 0 and mixers[0].offset.grad.abs().sum() > 0


def test_ssog_auto_path_by_grid_batch_and_grad():
    from timm_odevit.layers.mixers import OPERATOR_MAX_PATCHES
    m = SeparableGaussianMixer(12, 3)
    small, large = (4, 4), (OPERATOR_MAX_PATCHES // 4, 5)
    assert m.mixing_path(small, 8) == 'operator' and m.mixing_path(large, 8) == 'accumulate'
    assert m.mixing_path(large, 1) == 'accumulate'  # a backward follows: nothing value-sized is kept
    with torch.no_grad():  # inference: the one-op mixing, two matmuls per head
        assert m.mixing_path(large, 1) == 'fused' and m.mixing_path(large, 2) == 'fused'


@pytest.mark.parametrize('device', ['cpu', 'cuda'])
@pytest.mark.parametrize('grad', [False, True])
def test_auto_never_takes_the_triton_kernel_until_a_gpu_run_proves_it(device, grad, monkeypatch):
    """The chooser given a CUDA device (no GPU needed): the plain-torch paths until TRITON_PROVEN names the shape."""
    from timm_odevit.layers import mixers
    large = mixers.OPERATOR_MAX_PATCHES * 8
    plain = 'accumulate' if grad else 'fused'
    assert mixers.TRITON_PROVEN == ()  # no GPU run of the check has proven it yet
    assert mixers.choose_mixing_path('auto', large, grad, device) == plain
    assert mixers.choose_mixing_path('auto', 16, grad, device) == 'operator'
    assert mixers.choose_mixing_path('triton', 16, grad, device) == 'triton'  # asked for by name: given
    monkeypatch.setattr(mixers, 'TRITON_PROVEN', (('cuda', large, grad),))
    monkeypatch.setattr(mixers, 'HAS_TRITON', True)
    assert mixers.choose_mixing_path('auto', large, grad, device) == ('triton' if device == 'cuda' else plain)
    assert mixers.choose_mixing_path('auto', large - 1, grad, device) == plain


def test_the_triton_path_off_cuda_says_what_to_use():
    m = SeparableGaussianMixer(12, 3, mixing='triton')
    with pytest.raises(ValueError, match='runs on CUDA.*ssog_mixing="fused"'):
        m(torch.randn(1, 16, 12), (4, 4))


def test_ssog_inference_constants_kept_until_a_kernel_parameter_changes():
    """Without autograd the kernels are built once for an unchanged mixer, and again after an optimizer step, a
    state dict load, a change of dtype (autocast) or a change of grid; with autograd, every forward builds them
    (they belong to its graph)."""
    m = SeparableGaussianMixer(12, 3, learn_offset=True)
    calls = []
    kernels = m.kernels
    m.kernels = lambda grid_size: calls.append(grid_size) or kernels(grid_size)
    x = torch.randn(1, 1 + 16, 12)
    with torch.no_grad():
        first = m(x, (4, 4))
        torch.testing.assert_close(m(x, (4, 4)), first)
        assert len(calls) == 1
        m(x[:, :13], (3, 4))
        m(x, (4, 4))
        assert len(calls) == 3
        with torch.autocast('cpu', dtype=torch.bfloat16):
            m(x, (4, 4))
        assert len(calls) == 4
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for _ in range(2):
        m(x, (4, 4)).square().sum().backward()
        opt.step()
    assert len(calls) == 6
    with torch.no_grad():
        stepped = m(x, (4, 4))
        assert len(calls) == 7 and not torch.allclose(stepped, first)
        m.load_state_dict({k: v * 0.5 if k == 'log_sigma' else v for k, v in m.state_dict().items()})
        assert not torch.allclose(m(x, (4, 4)), stepped) and len(calls) == 8


def test_ssog_accumulate_backward_gradcheck():
    """The custom backward (values recomputed from the projection's input) against finite differences."""
    from timm_odevit.layers.mixers import _SeparableMixFn, _head_major
    torch.manual_seed(0)
    B, num_prefix, H, W, heads, C = 2, 1, 3, 5, 2, 4
    x = torch.randn(B, num_prefix + H * W, C, dtype=torch.float64)
    weight, bias = torch.randn(C, C, dtype=torch.float64), torch.randn(C, dtype=torch.float64)
    p = _head_major(torch.nn.functional.linear(x, weight, bias), num_prefix, H, W, heads).requires_grad_()
    gx = torch.rand(heads, 3, W, W, dtype=torch.float64, requires_grad=True)
    gy = torch.rand(heads, 3, H, H, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda p_, gx_, gy_: _SeparableMixFn.apply(p_, gx_, gy_, x, weight, bias, num_prefix, H, W), (p, gx, gy))


def test_ssog_mixing_option():
    assert SeparableGaussianMixer(8, 2).mixing == 'auto'
    with pytest.raises(ValueError, match='mixing must be'):
        SeparableGaussianMixer(8, 2, mixing='fft')
    from timm_odevit.layers.mixers import MIXER_OPTIONS
    assert 'mixing' in MIXER_OPTIONS['ssog']


@pytest.mark.parametrize('mixing', ['auto', 'operator', 'fused', 'accumulate', 'einsum'])
def test_ssog_mixing_on_meta(mixing):
    m = SeparableGaussianMixer(12, 3, mixing=mixing, device='meta')
    x = torch.empty(2, 1 + 3 * 5, 12, device='meta', requires_grad=True)
    out = m(x, (3, 5))
    assert out.shape == x.shape and out.is_meta
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_ssog_accumulate_compiles_fullgraph():
    mixers, x = _mix_pair((3, 5), 1, dtype=torch.float32)
    m, ref = mixers
    compiled = torch.compile(m, fullgraph=True, backend='aot_eager')
    xi = x.clone().requires_grad_()
    out = compiled(xi, (3, 5))
    out.square().sum().backward()
    xr = x.clone().requires_grad_()
    expected = ref(xr, (3, 5))
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(xi.grad, xr.grad)
    torch.testing.assert_close(m.log_sigma.grad, ref.log_sigma.grad)


def _steered_mixer_far_from_init(seed, num_gaussians, offset_std, log_sigma_std):
    """A float64 steered mixer (width 12, 2 heads, biased projections) with learned offsets and its probe and gates
    far from zero."""
    torch.manual_seed(seed)
    mixer = SeparableGaussianMixer(12, num_heads=2, num_gaussians=num_gaussians, learn_offset=True, bias=True,
                                   steer=True).double()
    with torch.no_grad():
        mixer.offset.normal_(0, offset_std)
        mixer.log_sigma.normal_(0, log_sigma_std)
        mixer.mix_logits.normal_()
        mixer.steer_weight.normal_(0, 0.5)
        mixer.steer_gate.fill_(1.0)
    return mixer


def _steered_reference(mixer, x, grid_size):
    """The steered mixer built entry by entry from its definition (docstring of ``_steered_mix``): for query
    q = (i, j) and source (i', j'), M[q, (i', j')] = sum_k a_k(q) G^y_{k,q}[i'] G^x_{k,(i',j)}[j'], each G a
    row-normalised Gaussian whose centre and width carry that position's residuals."""
    import math
    B, N, C = x.shape
    H, W = grid_size
    p = N - H * W
    heads, K, d = mixer.num_heads, mixer.num_gaussians, mixer.head_dim
    with torch.no_grad():
        v = mixer.v(x).double()
        r = mixer.steer_residuals(x[:, p:], grid_size).double()
        ls, off, logits = mixer.log_sigma.double(), mixer.offset.double(), mixer.mix_logits.double()

    def gauss(size, out, mu, sigma):
        w = [math.exp(-(out - src - mu) ** 2 / (2 * sigma ** 2)) for src in range(size)]
        return [wi / sum(w) for wi in w]
    mixed = torch.zeros(B, H * W, C, dtype=torch.float64)
    for b in range(B):
        for h in range(heads):
            op = torch.zeros(H * W, H * W, dtype=torch.float64)
            for i in range(H):
                for j in range(W):
                    a = (logits[h] + r[b, i, j, h, :, 4]).softmax(-1)
                    for k in range(K):
                        gy = gauss(H, i, float(off[0, h, k] + r[b, i, j, h, k, 2]),
                                   math.exp(float(ls[0, h, k] + r[b, i, j, h, k, 3])))
                        for i2 in range(H):
                            gx = gauss(W, j, float(off[1, h, k] + r[b, i2, j, h, k, 0]),
                                       math.exp(float(ls[1, h, k] + r[b, i2, j, h, k, 1])))
                            for j2 in range(W):
                                op[i * W + j, i2 * W + j2] += float(a[k]) * gy[i2] * gx[j2]
            mixed[b, :, h * d:(h + 1) * d] = op @ v[b, p:, h * d:(h + 1) * d]
    prefix = v[:, p:].mean(dim=1, keepdim=True).expand(B, p, C)
    return torch.cat([prefix, mixed], dim=1)


def test_steered_mixer_matches_entrywise_reference():
    """Steered SSoG on a non-square grid with CLS tokens, learned offsets and a probe far from zero, against the
    operator built entry by entry from its definition (the N x N matrix the mixer itself never forms)."""
    mixer = _steered_mixer_far_from_init(seed=0, num_gaussians=2, offset_std=0.5, log_sigma_std=0.3)
    x = torch.randn(2, 2 + 12, 12, dtype=torch.float64)
    ref = _steered_reference(mixer, x, (3, 4))
    with torch.no_grad():
        out = mixer(x, (3, 4))
        torch.testing.assert_close(out, mixer.proj(ref), rtol=1e-9, atol=1e-10)
    res = mixer.steer_residuals(x[:, 2:], (3, 4))
    assert res.abs().amax() > 0.1  # the probe really moved the kernels in this test
    bounds = torch.tensor([2.0, math.log(4.0), 2.0, math.log(4.0), 4.0], dtype=res.dtype)
    assert (res.abs() <= bounds).all()


def _steered_dense(mixer, x, grid_size):
    """The steered mixer as one differentiable N x N operator per image and head, built with plain softmaxes."""
    B, N, C = x.shape
    H, W = grid_size
    p = N - H * W
    v = mixer.v(x)
    r = mixer.steer_residuals(x[:, p:], grid_size)  # [B, H, W, heads, K, 5]
    ls, off = mixer.log_sigma, mixer.offset

    def gauss(size, centre, log_width, out_dim):  # rows over the source index, for output index i of out_dim
        i = torch.arange(size, dtype=x.dtype)
        d = (i[:, None] - i[None, :])[None, :, None, None, None, :] if out_dim == 1 else \
            (i[:, None] - i[None, :])[None, None, :, None, None, :]
        return (-(d - centre[..., None]) ** 2 / (2 * log_width.exp()[..., None] ** 2)).softmax(-1)
    gx = gauss(W, off[1] + r[..., 0], ls[1] + r[..., 1], 2)  # [B, i', j, heads, K, j']
    a = (mixer.mix_logits + r[..., 4]).softmax(-1)
    gy = gauss(H, off[0] + r[..., 2], ls[0] + r[..., 3], 1) * a[..., None]  # [B, i, j, heads, K, i']
    op = torch.einsum('bijhkI,bIjhkJ->bhijIJ', gy, gx)
    vp = v[:, p:].reshape(B, H, W, mixer.num_heads, mixer.head_dim)
    mixed = torch.einsum('bhijIJ,bIJhd->bijhd', op, vp).reshape(B, H * W, C)
    return mixer.proj(torch.cat([v[:, p:].mean(1, keepdim=True).expand(B, p, C), mixed], 1))


@pytest.mark.parametrize('columns_per_chunk,recompute', [(None, True), (1, True), (2, True), (None, False)])
def test_steered_mixer_gradients_match_dense_operator(monkeypatch, columns_per_chunk, recompute):
    """Gradients of the chunked steered mixing (inputs, kernel parameters, probe, gate) equal those of the dense
    operator built with plain softmaxes, whatever the chunking of the output columns, with each head checkpointed
    (training) or all heads at once (inside a block's checkpoint)."""
    import timm_odevit.layers.mixers as mixers
    if columns_per_chunk:  # None: the mixer's own chunking
        steered_mix = mixers._steered_mix
        monkeypatch.setattr(mixers, '_steered_mix', lambda *args, **kwargs: steered_mix(
            *args, **dict(kwargs, columns_per_chunk=columns_per_chunk)))
    mixer = _steered_mixer_far_from_init(seed=1, num_gaussians=3, offset_std=0.7, log_sigma_std=0.5)
    mixer.recompute_mixing = recompute
    x = torch.randn(2, 1 + 15, 12, dtype=torch.float64, requires_grad=True)
    grads = []
    for fn in (lambda: mixer(x, (3, 5)), lambda: _steered_dense(mixer, x, (3, 5))):
        mixer.zero_grad()
        x.grad = None
        out = fn()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        grads.append([out.detach(), x.grad.clone()] + [p.grad.clone() for p in mixer.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_steered_mixer_cold_start_equals_fixed_and_learns():
    """At initialisation the steered mixer is the fixed one; its probe and gate receive gradients; it has no
    Lipschitz bound or fixed operator to report."""
    torch.manual_seed(0)
    fixed = SeparableGaussianMixer(24, num_heads=3, learn_offset=True)
    steered = SeparableGaussianMixer(24, num_heads=3, learn_offset=True, steer=True)
    steered.load_state_dict(fixed.state_dict(), strict=False)
    x = torch.randn(2, 1 + 20, 24)
    torch.testing.assert_close(steered(x, (4, 5)), fixed(x, (4, 5)), rtol=1e-5, atol=1e-6)
    steered(x, (4, 5)).square().sum().backward()
    assert steered.steer_weight.grad.abs().sum() > 0
    with pytest.raises(TypeError, match='no global Lipschitz bound'):
        steered.lipschitz_bound((4, 5))
    with pytest.raises(TypeError, match='no fixed operator'):
        steered.dense_operator((4, 5))
