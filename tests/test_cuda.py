"""What only a CUDA device can check: every family forward and backward on the GPU, bf16 autocast, no host syncs in
a forward, torch.compile, and the allocator-level memory measurement. Skipped where CUDA is absent; run on a GPU
machine by ``benchmarks/gpu/run.sh``."""
import pytest
import timm
import torch

import timm_odevit  # noqa: F401  (registers the models)
from timm_odevit_tools.benchmark.runner import Case, measure_memory
from timm_odevit.layers import SeparableGaussianMixer
from timm_odevit.models.families import FAMILIES, model_name

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')

FAMILY_NAMES = list(FAMILIES)


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    # cuDNN convolutions (the patch embedding) default to TF32: compare float32 with float32
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)


def _small(family: str, **kwargs) -> torch.nn.Module:
    """The tiny 32 px model of a family, with its default settings, on the GPU."""
    torch.manual_seed(0)
    return timm.create_model(model_name(family, 'tiny', small_image=True), num_classes=10, **kwargs).cuda()


@pytest.mark.parametrize('family', FAMILY_NAMES)
def test_forward_backward_on_cuda(family):
    model = _small(family).train()
    x = torch.randn(4, 3, 32, 32, device='cuda')
    out = model(x)
    assert out.shape == (4, 10) and out.is_cuda
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.is_cuda and torch.isfinite(g).all() for g in grads)
    # the GPU computes what the CPU computes
    cpu = _small(family).cpu().eval()
    cpu.load_state_dict(model.state_dict())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).cpu(), cpu(x.cpu()), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize('family', FAMILY_NAMES)
def test_bf16_autocast_on_cuda(family):
    model = _small(family).train()
    x = torch.randn(4, 3, 32, 32, device='cuda')
    with torch.autocast('cuda', dtype=torch.bfloat16):
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), torch.arange(4, device='cuda'))
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize('family', FAMILY_NAMES)
def test_forward_without_host_sync(family):
    """A default model's forward never waits for the GPU (no .item(), no host-side NaN checks, no data-dependent
    shapes): each such read raises under sync debug mode 'error'."""
    model = _small(family).eval()
    x = torch.randn(2, 3, 32, 32, device='cuda')
    with torch.inference_mode():
        model(x)  # first call: lazy initialisation may legitimately sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('error')
        try:
            out = model(x)
        finally:
            torch.cuda.set_sync_debug_mode('default')
    assert out.shape == (2, 10)


@pytest.mark.parametrize('family', ['ssog_vit', 'ssog_ode'])
def test_compiled_forward_matches_eager(family):
    model = _small(family).eval()
    x = torch.randn(2, 3, 32, 32, device='cuda')
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-3, atol=1e-3)


def test_allocator_peak_on_cuda_and_accumulate_below_einsum():
    """The CUDA memory path measures a positive allocator-level peak; in a training step the accumulate mixing path,
    which keeps no value-sized tensor for backward, peaks lower than the einsum path (whose checkpoint keeps the
    values). Inference peaks are the MLP's in both, so they are not compared. Each path is asked for by name: 'auto'
    may pick another one (the Triton kernel, once TRITON_PROVEN lists it)."""
    peaks = {}
    for path in ('accumulate', 'einsum'):
        case = Case('ode', 'tiny', 'ssog', 512, 4)
        model = case.build_eager('cuda', torch.float32)
        mixers = [m for m in model.modules() if isinstance(m, SeparableGaussianMixer)]
        assert mixers
        for m in mixers:
            m.mixing = path
            with torch.enable_grad():
                assert m.mixing_path((32, 32), 4) == path
        status, mem = measure_memory(case, 'cuda', torch.float32, model=model)
        assert status == 'ok' and mem['method'] == 'cuda_max_allocated'
        assert mem['infer_mem_mb'] > 0 and mem['train_mem_mb'] > mem['infer_mem_mb']
        peaks[path] = mem
    assert peaks['accumulate']['train_mem_mb'] < peaks['einsum']['train_mem_mb']


# one parameter (benchmarks/gpu/run_tests.py's stand-in pytest takes one): dtype and batch
@pytest.mark.parametrize('case', [f'{d}/{b}' for d in ('float32', 'bfloat16', 'float16') for b in (1, 32)])
def test_fused_mixer_on_cuda_equals_the_reference(case):
    """The Triton kernel, asked for by name (``mixing='triton'``; 'auto' takes it only once proven): forward and
    backward equal the einsum path (float32) and stay within half precision's rounding (bf16, fp16)."""
    from timm_odevit.layers import SeparableGaussianMixer
    from timm_odevit.layers.fused_mixer import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip('Triton is not installed')
    dtype, batch = getattr(torch, case.split('/')[0]), int(case.split('/')[1])
    torch.manual_seed(0)
    grid = (20, 18)
    mixer = SeparableGaussianMixer(96, 3, learn_offset=True, mixing='triton').cuda()
    ref = SeparableGaussianMixer(96, 3, learn_offset=True, mixing='einsum').cuda()
    ref.load_state_dict(mixer.state_dict())
    assert mixer.mixing_path(grid, batch) == 'triton'
    x = torch.randn(batch, 1 + grid[0] * grid[1], 96, device='cuda')
    outs, grads = [], []
    for m in (mixer, ref):
        xi = x.clone().requires_grad_()
        with torch.autocast('cuda', dtype=dtype, enabled=dtype != torch.float32):
            out = m(xi, grid)
        out.float().square().mean().backward()
        outs.append(out.float())
        grads.append((xi.grad, m.log_sigma.grad))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < tol
    for a, b in zip(*grads):
        assert ((a - b).norm() / b.norm()).item() < tol * 10
