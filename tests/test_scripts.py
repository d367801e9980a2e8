"""timm's unmodified train.py / validate.py: the calls they make, run on our models, and the three routes that make
the scripts see our models (--device-modules, the launcher, the import hook).

The scripts are not on PyPI (only in timm's GitHub repository), so the calls are replayed here with the keyword
arguments the scripts pass (timm 1.0.31 / main: train.py main(), validate.py validate()).
"""
import argparse
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import timm
import timm_odevit  # noqa: F401
from timm.data import create_dataset, create_loader, resolve_data_config
from timm.models import load_checkpoint, resume_checkpoint
from timm.optim import create_optimizer_v2
from timm.task import ClassificationTask
from timm.utils import CheckpointSaver, ModelEmaV3

from timm_odevit import _autoload
from timm_odevit_tools import data as fm
from tiers import slow_except

REPO_ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = REPO_ROOT / 'weights'
# one per depth mode and mixer: discrete SSoG, looped dense, ODE SSoG
MODELS = ['ssog_vit_tiny_patch4_32', 'looped_vit_tiny_patch4_32', 'ssog_ode_tiny_patch4_32']


def _train_py_model(name: str, **over):
    # train.py main(): every keyword it passes; None values are dropped by timm.create_model
    kwargs = dict(pretrained=False, in_chans=1, num_classes=10, drop_rate=0.0,
                  drop_path_rate=0.0 if 'ode' in name else 0.1, drop_block_rate=None, global_pool=None,
                  bn_momentum=None, bn_eps=None, scriptable=False, checkpoint_path=None)
    kwargs.update(over)
    return timm.create_model(name, **kwargs)


def _args(**kw) -> argparse.Namespace:
    base = dict(in_chans=None, input_size=None, img_size=None, mean=None, std=None, crop_pct=None,
                interpolation='', model='x', checkpoint_hist=10)
    base.update(kw)
    return argparse.Namespace(**base)  # what train.py saves in checkpoints


@pytest.mark.parametrize('name', slow_except(MODELS, fast=lambda n: n.startswith('ssog_ode')))
def test_train_py_calls(name, tmp_path):
    torch.manual_seed(0)
    model = _train_py_model(name)
    data_config = resolve_data_config(vars(_args(img_size=32, mean=fm.FASHION_MNIST_MEAN, std=fm.FASHION_MNIST_STD,
                                                 in_chans=1)), model=model)
    assert data_config['input_size'] == (1, 32, 32) and data_config['mean'] == fm.FASHION_MNIST_MEAN

    task = ClassificationTask(model=model, criterion=nn.CrossEntropyLoss(), device=torch.device('cpu'),
                              dtype=None, verbose=False)
    model = task.get_trainable_module()
    # layer decay goes through the model's group_matcher: lr scales must differ between stem and head
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    scales = {round(g.get('lr_scale', 1.0), 6) for g in optimizer.param_groups}
    assert len(scales) > 2, scales
    no_decay = [g for g in optimizer.param_groups if g['weight_decay'] == 0.]
    assert no_decay and any(len(g['params']) for g in no_decay)
    ema = ModelEmaV3(model, decay=0.9)

    x, y = torch.randn(4, 1, 32, 32), torch.randint(0, 10, (4,))
    before = [p.detach().clone() for p in model.parameters()]
    out = task(x, y)
    assert set(out) >= {'loss', 'output'} and out['output'].shape == (4, 10)
    optimizer.zero_grad()
    out['loss'].backward()
    optimizer.step()
    ema.update(model, step=1)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    saver = CheckpointSaver(model=model, optimizer=optimizer, args=_args(model=name), model_ema=ema,
                            checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path), max_history=2)
    saver.save_checkpoint(epoch=0, metric=1.0)
    ckpt = tmp_path / 'last.pth.tar'
    assert ckpt.is_file()

    # validate.py --checkpoint (plain and --use-ema), train.py --resume
    fresh = _train_py_model(name).eval()
    load_checkpoint(fresh, str(ckpt), use_ema=False)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    load_checkpoint(fresh, str(ckpt), use_ema=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ema.module.state_dict().values()))
    resumed = _train_py_model(name)
    opt2 = create_optimizer_v2(resumed, opt='adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    assert resume_checkpoint(resumed, str(ckpt), optimizer=opt2, log_info=False) == 1
    with torch.no_grad():
        assert torch.equal(resumed.eval()(x), model.eval()(x))


@pytest.mark.slow
@pytest.mark.parametrize('amp_dtype', [None, torch.float16], ids=['float32', 'amp_float16'])
def test_validate_py_calls_on_published_weights(tmp_path, amp_dtype):
    # validate.py: create_model(model, pretrained, num_classes, in_chans, global_pool, scriptable, **model_kwargs);
    # train.py --pretrained-path feeds weights the same way, through pretrained_cfg_overlay(file=...); with --amp
    # every forward runs under torch.autocast(device_type, dtype=float16), validate.py's default --amp-dtype
    repo = WEIGHTS / 'ssog_ode_tiny_patch4_32.fmnist'
    model = timm.create_model('ssog_ode_tiny_patch4_32.fmnist', pretrained=True, num_classes=None, in_chans=1,
                              global_pool=None, scriptable=False,
                              pretrained_cfg_overlay=dict(file=str(repo / 'model.safetensors')))
    model.eval()
    data_config = resolve_data_config(vars(_args()), model=model, use_test_size=True)
    assert data_config['input_size'] == (1, 32, 32) and data_config['crop_pct'] == 1.0
    root = fm.layout_fashion_mnist(fm.SAMPLE_DIR, tmp_path / 'data')
    # --dataset torch/fashion_mnist --split validation: input_img_mode 'L' since the config has one channel
    dataset = create_dataset(root=str(root), name='torch/fashion_mnist', split='validation', download=False,
                             input_img_mode='L')
    loader = create_loader(dataset, input_size=data_config['input_size'], batch_size=125, use_prefetcher=False,
                           interpolation=data_config['interpolation'], mean=data_config['mean'],
                           std=data_config['std'], num_workers=0, crop_pct=data_config['crop_pct'],
                           crop_mode=data_config['crop_mode'], device=torch.device('cpu'))
    if amp_dtype is None:
        correct = n = 0
        with torch.inference_mode():
            for x, y in loader:
                correct += (model(x).argmax(-1) == y).sum().item()
                n += len(y)
        assert n == 1000
        card = (repo / 'README.md').read_text()
        assert f'({correct}/1000)' in card, 'validate.py path disagrees with the card'
        return
    # float16 autocast is emulated on CPUs (10x float32): the float32 case above holds the card's count on all
    # 1,000 images; here the first 125 of them, image by image, must give float32's logits and classes
    x, _ = next(iter(loader))
    with torch.inference_mode():
        ref = model(x)
        with torch.autocast('cpu', dtype=amp_dtype):
            out = model(x)
    assert out.dtype == torch.float16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(out.argmax(-1), ref.argmax(-1)), 'float16 autocast changed a class'


def test_validate_py_default_in_chans_gives_clear_error():
    # validate.py passes in_chans=3 unless told otherwise: the grey data then meets a 3-channel model
    model = timm.create_model('ssog_ode_tiny_patch4_32.fmnist', pretrained=False, in_chans=3)
    with pytest.raises(ValueError, match='in_chans=1'):
        model(torch.randn(1, 1, 32, 32))


SCRIPT = '''
import sys, timm
print(timm.is_model('ssog_ode_small'), repr(sys.argv[1:]), __name__)
'''


def test_device_modules_route():
    # train.py: `for module in args.device_modules: importlib.import_module(module)` before create_model
    code = ("import importlib, timm\nbefore = timm.is_model('ssog_ode_small')\n"
            "importlib.import_module('timm_odevit')\nprint(before, timm.is_model('ssog_ode_small'))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                       env={**_clean_env(), 'TIMM_ODEVIT_AUTOLOAD': '0'})
    assert r.stdout.split() == ['False', 'True'], r.stderr


def _clean_env():
    import os
    return {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH',)}


@pytest.mark.slow
def test_launcher_runs_script_with_its_argv(tmp_path):
    script = tmp_path / 'validate.py'
    script.write_text(SCRIPT)
    env = {**_clean_env(), 'TIMM_ODEVIT_AUTOLOAD': '0'}
    plain = subprocess.run([sys.executable, str(script), '--x'], capture_output=True, text=True, timeout=120,
                           env=env, cwd=str(tmp_path))
    launched = subprocess.run([sys.executable, '-m', 'timm_odevit.run', str(script), '--model', 'ssog_ode_small'],
                              capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO_ROOT))
    assert plain.stdout.split()[0] == 'False', 'the hook is off: a bare script must not see our models'
    assert launched.stdout.strip() == "True ['--model', 'ssog_ode_small'] __main__", launched.stderr
    missing = subprocess.run([sys.executable, '-m', 'timm_odevit.run', str(tmp_path / 'nope.py')],
                             capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode != 0 and 'no such script' in missing.stderr


@pytest.fixture()
def site_dir(tmp_path):
    """A site-packages-like folder holding exactly what setup.py installs for the hook."""
    d = tmp_path / 'site'
    d.mkdir()
    shutil.copy(Path(_autoload.__file__), d / f'{_autoload.MODULE_NAME}.py')
    (d / f'{_autoload.PTH_NAME}.pth').write_text(_autoload.PTH_LINE)
    (d / f'{_autoload.PTH_NAME}.start').write_text(_autoload.START_LINE)
    return d


def _python_with_site(site: Path, code: str, cwd: Path, **env):
    # -S: no start-up site processing, so a hook installed on this machine (its own, possibly older, copy of
    # _timm_odevit_autoload) cannot interfere. site.addsitedir processes the test folder exactly as interpreter
    # start-up does for site-packages; then this interpreter's package folders go on sys.path, without their .pth
    # files and after the hook module was imported from the test folder
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    boot = f'import site, sys\nsite.addsitedir({str(site)!r})\nsys.path.extend({paths!r})\n' + code
    return subprocess.run([sys.executable, '-S', '-c', boot], capture_output=True, text=True, timeout=120,
                          cwd=str(cwd), env={**_clean_env(), **env})


@pytest.mark.slow
def test_import_hook_registers_on_import_timm_alone(site_dir, tmp_path):
    code = ("assert 'timm' not in sys.modules and 'timm_odevit' not in sys.modules and 'torch' not in sys.modules\n"
            "import timm\nprint(timm.is_model('ssog_ode_small'), timm.is_model('looped_vit_tiny'), "
            "'timm_odevit' in sys.modules)")
    r = _python_with_site(site_dir, code, tmp_path)
    assert r.stdout.split() == ['True', 'True', 'True'], r.stderr
    off = _python_with_site(site_dir, code, tmp_path, TIMM_ODEVIT_AUTOLOAD='0')
    assert off.stdout.split() == ['False', 'False', 'False'], off.stderr


@pytest.mark.parametrize('plugin_text,reason',
                         slow_except([("raise RuntimeError('plugin exploded')\n", 'plugin exploded'),
                                      ('import sys\nsys.exit(3)\n', 'SystemExit')],
                                     fast=lambda c: c[1] == 'SystemExit'),
                         ids=['raises', 'calls_sys_exit'])
def test_import_hook_failure_is_a_warning(site_dir, tmp_path, plugin_text, reason):
    # a broken plugin earlier on sys.path, even one ending the process: `import timm` still works and says why
    broken = tmp_path / 'broken' / 'timm_odevit'
    broken.mkdir(parents=True)
    (broken / '__init__.py').write_text(plugin_text)
    code = (f"sys.path.insert(0, {str(broken.parent)!r})\nimport warnings\nwarnings.simplefilter('always')\n"
            "import timm\nprint('ok', timm.is_model('resnet50'), timm.is_model('ssog_ode_small'))")
    r = _python_with_site(site_dir, code, tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ['ok', 'True', 'False'], r.stderr
    assert reason in r.stderr and 'TIMM_ODEVIT_AUTOLOAD=0' in r.stderr


def test_import_hook_costs_nothing_without_timm(site_dir, tmp_path):
    # the work start-up does for the hook, counted as modules: exactly one small module, nothing it imports
    code = ('import site, sys\nbefore = set(sys.modules)\n'
            f'site.addsitedir({str(site_dir)!r})\nprint(sorted(set(sys.modules) - before))')
    r = subprocess.run([sys.executable, '-S', '-c', code], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path), env=_clean_env())
    assert r.returncode == 0 and r.stderr == '', r.stderr
    assert r.stdout.strip() == repr([_autoload.MODULE_NAME])


@pytest.mark.parametrize('module_text',
                         slow_except(["raise RuntimeError('autoload exploded')\n", 'import sys\nsys.exit(4)\n',
                                      'def install(:\n'], fast=lambda t: 'exit' in t),
                         ids=['raises', 'exits', 'syntax_error'])
def test_broken_autoload_module_is_silent_at_start_up(site_dir, tmp_path, module_text):
    (site_dir / f'{_autoload.MODULE_NAME}.py').write_text(module_text)
    r = _python_with_site(site_dir, "import timm\nprint('ok', timm.is_model('resnet50'))", tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ['ok', 'True'], r.stderr
    assert r.stderr == '', 'a broken hook module must not print at every start-up'


def test_start_twin_names_a_callable(site_dir, tmp_path):
    entry = (site_dir / f'{_autoload.PTH_NAME}.start').read_text().strip()
    mod, func = entry.split(':')
    r = _python_with_site(site_dir, f"import importlib\nf = getattr(importlib.import_module({mod!r}), {func!r})\n"
                                    "print(callable(f), 'timm_odevit' in sys.modules)", tmp_path)
    assert r.stdout.split() == ['True', 'False'], r.stderr


def test_setup_py_ships_the_hook_files():
    # setup.py builds its files from _autoload.py's literals: same names and contents as above
    src = (REPO_ROOT / 'setup.py').read_text().replace("\nsetup(cmdclass=", "\n_unused = dict(cmdclass=")
    mod = types.ModuleType('_setup_under_test')
    mod.__file__ = str(REPO_ROOT / 'setup.py')
    exec(compile(src, str(REPO_ROOT / 'setup.py'), 'exec'), mod.__dict__)
    files = mod.hook_files()
    assert files == {f'{_autoload.MODULE_NAME}.py': Path(_autoload.__file__).read_text(),
                     f'{_autoload.PTH_NAME}.pth': _autoload.PTH_LINE,
                     f'{_autoload.PTH_NAME}.start': _autoload.START_LINE}
