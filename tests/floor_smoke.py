"""The smoke check of the declared dependency floors (tests/test_floors.py runs it in a venv holding exactly them).

Run by that venv's python from a folder outside the checkout, offline (HF_HUB_OFFLINE=1, an empty HF_HOME): it imports
the library and the tools, builds one model of every family and runs it forward, solves with every ODE method the
package offers through torchdiffeq (the adjoint, with gradients), loads the default published weight (which ships in
the wheel), makes one training step of the trajectory distillation task and exports the trained student with
``python -m timm_odevit_tools.hub export``, loading the export back. Each step prints ``ok <step>``; the
first failure prints ``FLOOR SMOKE FAILED at <step>`` with its traceback and the installed versions, and exits 1.

    python tests/floor_smoke.py [work folder]   # the work folder defaults to a new temporary one
"""
import argparse
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

# the distributions whose floors pyproject.toml declares, and what they run against
DISTRIBUTIONS = ('timm', 'torchdiffeq', 'huggingface_hub', 'safetensors', 'torch', 'torchvision')
OK_LINE = 'FLOOR SMOKE OK'


def versions() -> Dict[str, str]:
    """Installed version of each of DISTRIBUTIONS ('missing' where not installed)."""
    out = {}
    for name in DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = 'missing'
    return out


def check_imports() -> None:
    import timm_odevit  # noqa: F401
    import timm_odevit_tools  # noqa: F401
    from timm_odevit import distill  # noqa: F401
    from timm_odevit_tools import hub, train, zoo  # noqa: F401
    # tests/test_floors.py checks that this is the venv's copy, not the checkout's
    print(f'   timm_odevit from {Path(timm_odevit.__file__).resolve().parent}')


def check_families() -> None:
    import timm
    import torch
    from timm_odevit.models.families import FAMILIES, model_name
    registered = set(timm.list_models(module=['odevit', 'ssog']))
    x = torch.randn(2, 3, 32, 32)
    for family in FAMILIES:
        name = model_name(family, 'tiny', small_image=True)
        assert name in registered, f'{name} is not registered with timm'
        torch.manual_seed(0)
        model = timm.create_model(name, num_classes=10, depth=2).eval()
        with torch.no_grad():
            y = model(x)
        assert y.shape == (2, 10) and bool(torch.isfinite(y).all()), f'{name}: output {tuple(y.shape)} or not finite'
        print(f'   {name}: forward {tuple(y.shape)}')


def check_torchdiffeq() -> None:
    """Every ODE method the package offers, through torchdiffeq: the fixed-grid Runge-Kutta ones with the adjoint
    (the package's own loop solves them otherwise: the two must agree), the adaptive and Adams ones as they are."""
    import timm
    import torch
    from timm_odevit.layers.integrators import METHODS, RK_TABLEAUS
    from timm_odevit.layers import ode_trunk
    torch.manual_seed(0)
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10, depth=2, ode_method='rk4').eval()
    trunk = ode_trunk(model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)  # rk4 on a fixed grid by the package's own loop
    done = []
    for method in METHODS:
        trunk.set_solver(method=method, adjoint=False)
        with torch.no_grad():
            loop = model(x)
        trunk.set_solver(adjoint=True)
        model.zero_grad()
        y = model(x)  # with gradients: odeint_adjoint, whatever the method
        y.square().sum().backward()
        assert trunk.nfe > 0 and bool(torch.isfinite(y).all()), f'{method}: nfe {trunk.nfe} or not finite'
        if method in RK_TABLEAUS:
            assert torch.allclose(y, loop, atol=1e-4), f'{method}: adjoint differs by {(y - loop).abs().max()}'
        assert torch.allclose(y, ref, atol=0.05, rtol=0.05), f'{method}: differs from rk4 by {(y - ref).abs().max()}'
        grads = [p.grad for p in trunk.parameters() if p.requires_grad]
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads), f'{method}: adjoint gradients'
        assert any(bool(g.abs().sum() > 0) for g in grads), f'{method}: the adjoint gave zero gradients'
        done.append(f'{method} ({trunk.nfe})')
    print('   solved with the adjoint (nfe): ' + ', '.join(done))


def check_default_weight() -> None:
    import timm
    import torch
    from timm_odevit_tools.hub.demo import DEFAULT_MODEL, DEFAULT_REPO
    assert os.environ.get('HF_HUB_OFFLINE') == '1', 'run offline: HF_HUB_OFFLINE=1'
    model = timm.create_model(DEFAULT_MODEL, pretrained=True).eval()
    cfg = model.pretrained_cfg
    assert f"{cfg['architecture']}.{cfg['tag']}" == DEFAULT_REPO, f'loaded {cfg["architecture"]}.{cfg["tag"]}'
    # the loaded tensors are the published file's, not a fresh initialisation
    from safetensors.torch import load_file
    from huggingface_hub import try_to_load_from_cache
    path = try_to_load_from_cache(cfg['hf_hub_id'], 'model.safetensors')
    assert isinstance(path, str), f'{cfg["hf_hub_id"]} is not in the Hugging Face cache after loading: {path}'
    stored = load_file(path)
    state = model.state_dict()
    assert stored.keys() == state.keys(), sorted(set(stored) ^ set(state))[:5]
    assert all(torch.equal(stored[k].float(), state[k].float()) for k in stored), 'loaded weights differ from file'
    with torch.no_grad():
        y = model(torch.randn(2, *cfg['input_size']))
    assert y.shape == (2, 10) and bool(torch.isfinite(y).all())
    print(f'   {DEFAULT_MODEL}: {DEFAULT_REPO} from {path}')


def check_distill_and_export(work: Path) -> None:
    import argparse as ap
    import timm
    import torch
    from timm_odevit.distill import LOSS_KEYS, TrajectoryDistillationTask
    torch.manual_seed(0)
    teacher = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=4, depth=3, num_classes=10)
    arch, kwargs = 'odevit_tiny_patch4_32', {'depth': 3}  # a dense-attention student: the attention loss too
    student = timm.create_model(arch, num_classes=10, in_chans=1, **kwargs)
    # a grey student under an RGB teacher, as on Fashion-MNIST: the patch embedding cannot be copied across
    task = TrajectoryDistillationTask(student, teacher, times='paper', kd_loss_weight=1., verbose=False,
                                      init_from_teacher=('cls_token', 'pos_embed', 'head'))
    params = [p for p in task.get_trainable_module().parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    task.train()
    x, y = torch.randn(4, 1, 32, 32), torch.randint(0, 10, (4,))
    out = task(x, y)
    losses = {k: float(out[k].detach()) for k in ('loss',) + tuple(LOSS_KEYS)}
    assert all(v == v and abs(v) != float('inf') for v in losses.values()), losses
    opt.zero_grad()
    out['loss'].backward()
    opt.step()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params)), 'the step changed no parameter'
    print('   distillation step: ' + ', '.join(f'{k} {v:.4f}' for k, v in losses.items()))

    trained = task.trainable_module_student().eval()
    ckpt = work / 'last.pth.tar'
    torch.save({'arch': arch, 'state_dict': trained.state_dict(),
                'args': ap.Namespace(model=arch, model_kwargs=kwargs)}, ckpt)
    root = work / 'weights'
    r = subprocess.run([sys.executable, '-m', 'timm_odevit_tools.hub', 'export', str(ckpt), '--tag', 'floors',
                        '--root', str(root), '--no-full'], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f'export exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}'
    repo = root / f'{arch}.floors'
    files = sorted(p.name for p in repo.iterdir())
    assert {'README.md', 'config.json', 'model.safetensors'} <= set(files), files
    loaded = timm.create_model(f'local-dir:{repo}', pretrained=True).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(x), trained(x), atol=1e-5), 'the exported weights give other outputs'
    print(f'   export: {repo.name} ({", ".join(files)}), loaded back equal')


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('work', nargs='?', default=None, help='a folder to write the export into')
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix='floor_smoke.'))
    work.mkdir(parents=True, exist_ok=True)
    print('versions: ' + ', '.join(f'{k}=={v}' for k, v in versions().items()), flush=True)
    steps: List[Tuple[str, Callable[[], None]]] = [
        ('imports', check_imports),
        ('model families', check_families),
        ('torchdiffeq solvers', check_torchdiffeq),
        ('default published weight', check_default_weight),
        ('distillation step and export', lambda: check_distill_and_export(work)),
    ]
    for name, step in steps:
        try:
            step()
        except BaseException:  # noqa: B036  (an import error, an assert, a SystemExit of the export: all fail)
            traceback.print_exc(file=sys.stdout)
            print(f'FLOOR SMOKE FAILED at {name} (' + ', '.join(f'{k}=={v}' for k, v in versions().items()) + ')',
                  flush=True)
            return 1
        print(f'ok {name}', flush=True)
    print(OK_LINE, flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
