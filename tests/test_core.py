"""The sync-free, compile-ready core: no host reads in forward, torch.compile(fullgraph), timm's contract closed."""
import math

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import timm_odevit  # noqa: F401  (registers the models)
from timm_odevit.layers import FieldBlock, MultiHeadAttention
from timm_odevit.layers.block import GELU_LIPSCHITZ
from timm_odevit.models.families import FAMILIES, SIZES, model_name
from tiers import slow_except

# every untagged registered model: the families at each size and image size, and the ODE-ViT paper configs
DEFAULT_MODELS = sorted(
    [model_name(f, s, small) for f in FAMILIES for s in SIZES for small in (False, True)]
    + ['odevit_w768_mlp1_36pt', 'odevit_w768_mlp4_24pt'])
HOST_READ_METHODS = ('item', '__bool__', 'tolist', '__float__', '__int__', 'cpu', 'numpy')


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values by the host: every op that turns a tensor into a Python scalar dispatches
    ``_local_scalar_dense`` (on CUDA, a stream sync); ``tolist``, ``cpu`` and ``numpy`` are counted at the Python
    level by ``count_host_reads``, since on CPU they need no dispatch. A tensor made from Python data
    (``torch.tensor([...], device=...)``, dispatched as ``lift_fresh``) is counted too: on CUDA it is a copy from
    the host that waits for the GPU (an H200 run found one in the steered mixer, which this counter then missed)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def count_host_reads(monkeypatch, fn):
    mode = HostReads()
    for name in HOST_READ_METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            mode.reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    with mode:
        fn()
    monkeypatch.undo()
    return mode.reads


@pytest.fixture
def fresh_dynamo():
    """Each compile test starts from an empty dynamo cache: many model instances compiled in one process would
    otherwise run into dynamo's per-code-object recompile limit (8), which fullgraph=True turns into an error."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_host_read_counter_sees_reads(monkeypatch):
    """The counter itself: each way of reading a value back is seen."""
    x = torch.ones(3)
    reads = count_host_reads(monkeypatch, lambda: (x.sum().item(), bool(x.all()), x.tolist(), float(x[0])))
    assert len(reads) >= 4
    made_from_python = count_host_reads(monkeypatch, lambda: x * torch.tensor([2.0, 3.0, 4.0]))
    assert made_from_python == [str(torch.ops.aten.lift_fresh.default)]


def test_host_read_counter_sees_an_adaptive_solve(monkeypatch):
    """An adaptive solve decides its steps from values, so it must read them back: the counter sees it."""
    model = timm.create_model('ssog_ode_tiny_patch4_32', ode_method='dopri5').eval()
    with torch.inference_mode():
        reads = count_host_reads(monkeypatch, lambda: model(torch.randn(1, 3, 32, 32)))
    assert len(reads) > 10


@pytest.mark.parametrize('name', slow_except(DEFAULT_MODELS, fast=lambda n: 'tiny' in n))
def test_forward_reads_nothing_back(monkeypatch, name):
    """No default model reads a tensor value back to the host in forward (on CUDA each would stall the stream);
    the input checks and the ODE solver's grid are decided in Python."""
    model = timm.create_model(name, weight_init='skip').eval()
    x = torch.randn(1, *model.pretrained_cfg['input_size'])
    with torch.inference_mode():
        reads = count_host_reads(monkeypatch, lambda: model(x))
    assert reads == [], f'{name} read {len(reads)} values back to the host: {reads[:5]}'
    assert model.nfe >= 12


def test_nonfinite_input_still_refused_without_host_read():
    model = timm.create_model('ssog_ode_tiny_patch4_32', weight_init='skip')
    x = torch.randn(1, 3, 32, 32)
    x[0, 0, 0, 0] = float('nan')
    with pytest.raises(ValueError, match='NaN or Inf'):
        model(x)
    model.check_finite = False  # opted out: NaN flows through (as in any torch model)
    assert torch.isnan(model(x)).all()


@pytest.mark.parametrize('family', slow_except(list(FAMILIES), fast=lambda f: f == 'odevit'))
def test_compile_fullgraph_forward_backward(family, fresh_dynamo):
    """Each family compiles to one graph (fullgraph=True), forward and backward, and matches eager."""
    torch.manual_seed(0)
    model = timm.create_model(model_name(family, 'tiny', small_image=True), num_classes=10).train()
    x = torch.randn(4, 3, 32, 32)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)
    assert model.nfe == 12


@pytest.mark.parametrize('family', slow_except(list(FAMILIES), fast=lambda f: f == 'looped_vit'))
def test_compile_fullgraph_224(family, fresh_dynamo):
    """The 224 px variants (patch 16) capture in one graph as well (dynamo only: the backend runs eagerly)."""
    model = timm.create_model(model_name(family, 'tiny'), weight_init='skip').eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True, backend='eager')(x), model(x))


def test_compile_respects_solver_change(fresh_dynamo):
    """Changing the solver on a built model takes effect in the compiled model (a guard, not a stale graph)."""
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10).eval()
    compiled = torch.compile(model, fullgraph=True, backend='eager')
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        compiled(x)
        model.set_solver(method='rk4', steps=6)
        out = compiled(x)
        assert model.nfe == 24
        torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize('name,kwargs', [
    ('dense_vit_tiny', dict(num_gaussians=2)),
    ('dense_vit_tiny', dict(ode_method='dopri5')),
    ('ssog_vit_tiny', dict(ode_steps=6)),
    ('looped_ssog_tiny', dict(ode_adjoint=True)),
    ('odevit_tiny', dict(prefix_mixing='none')),
    ('ssog_ode_tiny', dict(attn_drop_rate=0.1)),
    ('odevit_tiny', dict(ssog_steer=True)),
    ('looped_vit_tiny', dict(ssog_mixing='einsum')),
])
def test_inapplicable_options_raise_type_error(name, kwargs):
    with pytest.raises(TypeError, match='apply to|applies to'):
        timm.create_model(name, device='meta', **kwargs)


def test_applicable_options_accepted():
    assert timm.create_model('ssog_ode_tiny', device='meta', num_gaussians=2, ode_method='rk4').trunk.method == 'rk4'
    assert timm.create_model('odevit_tiny', device='meta', attn_drop_rate=0.1).trunk.block.mixer.attn_drop == 0.1
    model = timm.create_model('looped_ssog_tiny', device='meta', ssog_mixing='einsum', ssog_steer=True)
    mixer = model.trunk.block.mixer
    assert mixer.mixing == 'einsum' and mixer.steer


@pytest.mark.parametrize('name', ['looped_ssog_tiny_patch4_32', 'odevit_tiny_patch4_32'])
@pytest.mark.parametrize('feature_cls', ['hook', 'fx'])
def test_features_only_hook_fx_refused_for_shared_blocks(name, feature_cls):
    with pytest.raises(ValueError, match="feature_cls='getter'"):
        timm.create_model(name, features_only=True, feature_cls=feature_cls)


@pytest.mark.parametrize('feature_cls', slow_except(['hook', 'fx'], fast=lambda c: c == 'hook'))
def test_features_only_hook_fx_work_for_discrete(feature_cls):
    model = timm.create_model('ssog_vit_tiny_patch4_32', features_only=True, feature_cls=feature_cls,
                              out_indices=(3, 11))
    feats = model(torch.randn(1, 3, 32, 32))
    assert len(feats) == 2


def test_attention_follows_timm_fused_attn_switch():
    """Fused by default as timm's Attention; the eager path materialises the same attention."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).eval()
    assert attn.fused_attn == timm.layers.use_fused_attn()
    x = torch.randn(2, 9, 32)
    fused = attn(x)
    attn.fused_attn = False
    torch.testing.assert_close(attn(x), fused, rtol=1e-5, atol=1e-6)


def test_gelu_lipschitz_constant_is_an_upper_bound():
    x = torch.linspace(-6, 6, 2_000_001, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(torch.nn.functional.gelu(x).sum(), x)
    assert grad.abs().max().item() <= GELU_LIPSCHITZ
    assert GELU_LIPSCHITZ - grad.abs().max().item() < 1e-4  # and a tight one


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float64])
def test_input_dtype_mismatch_says_what_to_do(dtype):
    model = timm.create_model('ssog_vit_tiny_patch4_32', weight_init='skip')
    with pytest.raises(ValueError, match='Cast the input'):
        model(torch.randn(1, 3, 32, 32, dtype=dtype))


def test_autocast_input_dtype_allowed():
    model = timm.create_model('ssog_vit_tiny_patch4_32', weight_init='skip').eval()
    with torch.autocast('cpu', dtype=torch.bfloat16), torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32, dtype=torch.bfloat16)).shape == (1, 1000)


def test_mixer_recompute_does_not_nest_in_grad_checkpointing():
    """With whole-block checkpointing the einsum path's own recompute stands down; gradients are unchanged."""
    torch.manual_seed(0)
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10)
    mixer = model.trunk.block.mixer
    mixer.mixing = 'einsum'
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    assert mixer.within_checkpoint
    model(x).sum().backward()
    for p, g in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    model.set_grad_checkpointing(False)
    assert not mixer.within_checkpoint and math.isfinite(float(model.lipschitz_bound()))


@pytest.mark.parametrize('family', slow_except(list(FAMILIES), fast=lambda f: f == 'ssog_ode'))
def test_torch_export_and_onnx(family, fresh_dynamo):
    """Every fixed-grid family exports with torch.export, and through it to ONNX; onnxruntime agrees with torch."""
    onnxruntime = pytest.importorskip('onnxruntime')
    pytest.importorskip('onnxscript')
    torch.manual_seed(0)
    model = timm.create_model(model_name(family, 'tiny', small_image=True), num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
    program = torch.export.export(model, (x,))
    torch.testing.assert_close(program.module()(x), ref)
    onnx_program = torch.onnx.export(program, (x,), dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(
        onnx_program.model_proto.SerializeToString(), providers=['CPUExecutionProvider'])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_steered_option_compiles_and_exports(fresh_dynamo):
    """The steered SSoG option (a model kwarg) compiles to one graph forward and backward, and exports."""
    torch.manual_seed(0)
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10, ssog_steer=True).train()
    with torch.no_grad():
        model.trunk.block.mixer.steer_weight.normal_(0, 0.05)
        model.trunk.block.mixer.steer_gate.fill_(0.)
    x = torch.randn(2, 3, 32, 32)
    ref = model(x)
    out = torch.compile(model, fullgraph=True, backend='aot_eager')(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert model.trunk.block.mixer.steer_weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.export.export(model, (x,)).module()(x), model(x))


def test_integer_pixels_are_told_to_convert_not_to_cast_the_model():
    """uint8 images (as decoded) cannot meet a float model by a cast of the model: the message says how to convert."""
    model = timm.create_model('ssog_vit_tiny_patch4_32', weight_init='skip')
    with pytest.raises(ValueError, match=r'got torch.uint8 pixels. Convert them: x = x.to\(torch.float32\) / 255') as e:
        model(torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8))
    assert 'model.to(torch.uint8)' not in str(e.value)
