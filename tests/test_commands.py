"""Every command ends honestly: exit 0 when it did its job, 2 with one line naming the option or file and the fix for
input that cannot work (no traceback unless --debug), non-zero when the job failed (a diverged run); and the loading
paths agree with timm's own views of our weights."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import timm
import timm_odevit  # noqa: F401
from timm_odevit_tools import data as fm
from timm_odevit_tools.cli import DEBUG_ENV
from timm_odevit_tools.train.command import cli, read_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = REPO_ROOT / 'weights'
ODE_ARCH = 'ssog_ode_tiny_patch4_32'


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
    monkeypatch.delenv(DEBUG_ENV, raising=False)


def tiny_run(out: Path, *extra: str, model: str = ODE_ARCH) -> list:
    return ['--data-dir', str(fm.SAMPLE_DIR), '--train-split', 'test', '--model', model, '--model-kwargs', 'depth=2',
            '--train-samples', '32', '--val-samples', '16', '--batch-size', '8', '--max-steps-per-epoch', '2',
            '--epochs', '1', '--output', str(out), '--experiment', 'run', '--log-interval', '1', '--device', 'cpu',
            *extra]


def _env() -> dict:
    env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY='1', PYTHONWARNINGS='ignore')
    env.pop(DEBUG_ENV, None)
    return env


@pytest.mark.parametrize('module', ['timm_odevit.train', 'timm_odevit_tools.train'])
def test_a_finished_training_run_exits_0_through_either_name(module, tmp_path):
    """The cards' name (timm_odevit.train) and the tools' name: 0 after a good run, nothing on stderr but the log."""
    r = subprocess.run([sys.executable, '-m', module, *tiny_run(tmp_path)], capture_output=True, text=True,
                       timeout=600, env=_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'top1'" not in r.stderr and (tmp_path / 'run' / 'results.json').is_file()


@pytest.mark.parametrize('lr', ['1e8', '1e30'])
def test_a_diverging_run_stops_says_where_and_keeps_no_nonfinite_checkpoint(lr, tmp_path, capsys):
    status = cli(tiny_run(tmp_path, '--lr', lr, '--clip-grad', 'inf', '--max-steps-per-epoch', '4'))
    err = capsys.readouterr().err
    assert status == 3, err
    # the command's own lines (an earlier test's closed capture may leave logging's complaints above them)
    err = err[err.index('python -m timm_odevit_tools.train: failed:'):]
    assert 'training diverged' in err and 'became non-finite at' in err and '--lr' in err and 'Traceback' not in err
    last = tmp_path / 'run' / 'last.pth.tar'
    if last.exists():  # a checkpoint that is there holds finite weights only
        state = read_checkpoint(str(last))['state_dict']
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


@pytest.mark.parametrize('argv, says', [
    (['--lr', 'inf'], '--lr must be a finite number'),
    (['--device', 'cuda:0'], '--device cuda:0: this machine has no CUDA device'),
    (['--img-size', '30'], "--img-size 30 is not a multiple of"),
    (['--model-kwargs', 'depth='], "--model-kwargs depth=''"),
    (['--model-kwargs', 'depth=2', 'nonsense=1'], "unexpected keyword argument 'nonsense'"),
    (['--train-samples', '100000000'], 'ask for at most 1000'),
    (['--output', '/dev/null'], '--output /dev/null: cannot make the run folder'),
    (['--data-dir', '/nonexistent/fmnist'], '--data-dir /nonexistent/fmnist does not exist'),
    (['--solvers', 'rk5:3'], "--solvers: solver 'rk5:3'"),
    (['--solvers', 'euler:4', '--model', 'ssog_vit_tiny_patch4_32'], 'train an ODE trunk'),
])
def test_user_errors_of_the_training_command_are_one_message_exit_2(argv, says, tmp_path, capsys):
    if cuda := (argv[0] == '--device' and torch.cuda.is_available()):
        pytest.skip('this machine has a CUDA device')
    base = tiny_run(tmp_path)
    if '--model' in argv:  # the model of the case, without the ODE model's depth option
        base = [a for a in base if a not in (ODE_ARCH, '--model', '--model-kwargs', 'depth=2')]
    if argv[0] in ('--model-kwargs', '--train-samples'):
        i = base.index(argv[0])
        base[i:i + 2] = []
    status = cli(base + argv)
    err = capsys.readouterr().err
    assert status == 2 and not cuda, err
    err = err[err.index('python -m timm_odevit_tools.train: error:'):]
    assert says in err and 'Traceback' not in err, err


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match='is not a multiple of'):
        cli(tiny_run(tmp_path, '--img-size', '30', '--debug'))


@pytest.mark.parametrize('data, says', [
    ('sampel', "--data sampel: no such folder; did you mean 'sample'?"),
    ('empty', 'holds no Fashion-MNIST IDX files'),
    ('garbage', 'is not a uint8 IDX file'),
    ('truncated', 'is corrupt'),
])
def test_hub_evaluate_on_bad_data_is_one_message_exit_2(data, says, tmp_path, capsys):
    from timm_odevit_tools.hub.__main__ import cli as hub_cli
    folder = tmp_path / data
    folder.mkdir()
    if data == 'garbage':
        for name in ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'):
            (folder / name).write_bytes(os.urandom(3000))
    elif data == 'truncated':
        for name in ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz'):
            shutil.copy(fm.SAMPLE_DIR / name, folder / name)
        import gzip
        images = gzip.decompress((folder / 't10k-images-idx3-ubyte.gz').read_bytes())
        (folder / 't10k-images-idx3-ubyte.gz').write_bytes(gzip.compress(images[:5000]))
    arg = 'sampel' if data == 'sampel' else str(folder)
    status = hub_cli(['evaluate', str(WEIGHTS / f'{ODE_ARCH}.fmnist'), '--data', arg])
    err = capsys.readouterr().err
    assert status == 2, err
    err = err[err.index('python -m timm_odevit_tools.hub: error:'):]
    assert says in err and 'Traceback' not in err, err


def test_is_model_pretrained_agrees_with_pretrained_true():
    published = {k.split('/')[0].split('.')[0] for k in json.loads((WEIGHTS / 'MANIFEST.json').read_text())['files']}
    ours = {m for m in timm.list_models() if m in published or m.split('.')[0] in published}
    assert ours == published
    assert all(timm.is_model_pretrained(a) for a in published)
    assert not timm.is_model_pretrained('ssog_vit_small')  # no weight published: False, as before


def test_fixed_weights_load_into_a_steered_model_and_give_the_fixed_outputs():
    fixed = timm.create_model('ssog_ode_tiny_patch4_32.fmnist', pretrained=True).eval()
    steered = timm.create_model('ssog_ode_tiny_patch4_32.fmnist', pretrained=True, ssog_steer=True).eval()
    fresh = timm.create_model('ssog_ode_tiny_patch4_32', ssog_steer=True)
    mixer, fresh_mixer = steered.trunk.block.mixer, fresh.trunk.block.mixer
    assert torch.equal(mixer.steer_gate, fresh_mixer.steer_gate)
    assert torch.equal(mixer.steer_weight, fresh_mixer.steer_weight)
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(steered(x), fixed(x), atol=1e-5, rtol=1e-5)


def test_a_config_json_naming_an_unknown_architecture_names_the_file(tmp_path, monkeypatch):
    from timm_odevit.models.pretrained import route_hf_hub_configs
    from timm.models import _factory
    config = json.loads((WEIGHTS / f'{ODE_ARCH}.fmnist' / 'config.json').read_text())
    config['architecture'] = 'ssog_ode_tinyy'
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(config))
    monkeypatch.setattr('timm.models._hub.download_from_hf', lambda *a, **k: str(path))
    route_hf_hub_configs()  # idempotent: the wrapper installed at import stays the only one
    assert getattr(_factory.load_model_config_from_hf, '_timm_odevit', False)
    with pytest.raises(RuntimeError, match=r"config.json of hf-hub:other-org/x names the architecture "
                                           r"'ssog_ode_tinyy', which timm does not know"):
        timm.create_model('hf-hub:other-org/x')


@pytest.mark.parametrize('damage', ['flipped_byte', 'nan_weight'])
def test_a_damaged_local_dir_is_refused_naming_the_file(damage, tmp_path):
    from safetensors.torch import load_file, save_file
    root = tmp_path / 'weights'
    repo = f'{ODE_ARCH}.fmnist'
    shutil.copytree(WEIGHTS / repo, root / repo)
    shutil.copy(WEIGHTS / 'MANIFEST.json', root / 'MANIFEST.json')
    path = root / repo / 'model.safetensors'
    if damage == 'flipped_byte':
        data = bytearray(path.read_bytes())
        data[-7] ^= 1  # the header is intact: the tensors parse, their values are wrong
        path.write_bytes(bytes(data))
        message = rf'{path} is not the file {root / "MANIFEST.json"} lists \(its sha256 differs\)'
    else:
        (root / 'MANIFEST.json').unlink()  # no manifest to check against: the values are
        state = load_file(str(path))
        state['head.weight'][0, 0] = float('nan')
        save_file(state, str(path), metadata={'format': 'pt'})
        message = rf'pretrained weights from {root / repo} hold NaN or Inf values .*head.weight'
    with pytest.raises(RuntimeError, match=message):
        timm.create_model(f'local-dir:{root / repo}', pretrained=True)


def test_the_input_check_makes_no_device_assert_off_the_cpu(monkeypatch):
    """On CUDA a NaN check would be a device-side assert, which ends the CUDA context: the check runs on the CPU
    only (a meta tensor stands for the device here)."""
    from timm_odevit.models import trunk
    model = timm.create_model('ssog_ode_tiny_patch4_32', in_chans=1, num_classes=10)
    with pytest.raises(ValueError, match='NaN or Inf'):
        model(torch.full((1, 1, 32, 32), float('nan')))
    calls = []
    monkeypatch.setattr(trunk, 'check_finite_async', lambda x: calls.append(x.device.type))
    for device in ('cpu', 'meta'):
        trunk.check_image_input(torch.zeros(1, 1, 32, 32, device=device), 1, (32, 32), (4, 4), False, False)
    assert calls == ['cpu']


def test_hub_serve_refuses_an_empty_root_and_warns_off_loopback(tmp_path):
    r = subprocess.run([sys.executable, '-m', 'timm_odevit_tools.hub', 'serve', '--root', str(tmp_path),
                        '--duration', '1'], capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 2 and 'holds no Hub repos' in r.stderr, r.stderr
    r = subprocess.run([sys.executable, '-m', 'timm_odevit_tools.hub', 'serve', '--root', str(WEIGHTS),
                        '--host', '0.0.0.0', '--port', '0', '--duration', '1', '--no-verify'],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr
    assert 'every machine that reaches this interface can download' in r.stderr + r.stdout


def test_endpoint_advice_never_names_a_privileged_port():
    from timm_odevit.models.pretrained import _mirror_advice
    assert '--port' not in _mirror_advice('x', 'http://127.0.0.1:80')
    assert '--port 8999' in _mirror_advice('x', 'http://127.0.0.1:8999')


def test_an_endpoint_without_a_scheme_or_not_a_hub_is_named():
    from timm_odevit.models.pretrained import _endpoint_problem
    assert 'must start with http://' in _endpoint_problem('127.0.0.1:8765', 'timm-odevit/x')


def test_acceleration_is_the_finite_difference_of_the_field_along_the_solve_and_compiles():
    """track_acceleration: sum over steps of |f(x_n+1) - f(x_n)|^2 / h, meaned over elements, over the interval; the
    same number from a fullgraph compile, and a gradient reaches the field."""
    from timm_odevit.layers import ode_trunk
    torch.manual_seed(0)
    model = timm.create_model(ODE_ARCH, in_chans=1, num_classes=10, depth=3, ode_steps=3)
    trunk = ode_trunk(model)
    fields = []
    trunk.block.register_forward_hook(lambda m, a, out: fields.append(out.detach()))
    x = torch.randn(2, 1, 32, 32)
    trunk.track_acceleration = True
    model(x)
    h = trunk.t_end / trunk.steps
    expected = sum((fields[i + 1] - fields[i]).pow(2).mean() / h for i in range(len(fields) - 1)) / trunk.t_end
    torch.testing.assert_close(trunk.acceleration.detach(), expected)
    eager = trunk.acceleration.detach()
    trunk.acceleration = None
    torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(trunk.acceleration.detach(), eager, rtol=1e-4, atol=1e-6)
    trunk.acceleration.backward()
    assert model.trunk.block.mlp.fc1.weight.grad.abs().sum() > 0


def test_random_solvers_draw_from_the_set_and_give_the_trunk_its_grid_back():
    from timm_odevit.layers import ode_trunk
    from timm_odevit_tools.train.solvers import RandomSolvers
    trunk = ode_trunk(timm.create_model(ODE_ARCH, in_chans=1, num_classes=10, depth=2))
    before = trunk.solver_options()
    seen = []
    sampler = RandomSolvers(['euler:1', 'midpoint:2', 'rk4:1'], seed=3)
    for _ in range(30):
        with sampler.drawn(trunk):
            seen.append((trunk.method, trunk.steps))
    assert set(seen) == {('euler', 1), ('midpoint', 2), ('rk4', 1)} and trunk.solver_options() == before
    again = RandomSolvers(['euler:1', 'midpoint:2', 'rk4:1'], seed=3)
    assert [again.rng.choice(again.solvers) for _ in range(30)] == seen  # seeded: a resumed epoch draws alike
    with pytest.raises(ValueError, match="solver 'dopri5:3'.*euler"):
        RandomSolvers(['dopri5:3'])


def test_solver_robust_training_logs_the_penalty_and_keeps_the_training_grid(tmp_path):
    out = tmp_path / 'run'
    assert cli(tiny_run(tmp_path, '--solvers', 'euler:1,rk4:1', '--accel-weight', '0.1')) == 0
    log = (out / 'train.log').read_text()
    assert ' accel ' in log
    results = json.loads((out / 'results.json').read_text())
    assert results['nfe'] == 2  # validated on the model's own grid (2 Euler steps at depth 2), not a drawn one
    command = (out / 'command.txt').read_text()
    assert '--solvers euler:1,rk4:1 --accel-weight 0.1' in command


def test_solver_robust_guidance_warns_of_jasmins_gradient_unless_detached():
    """--solvers on a guided student with attention maps: JaSMin's gradient on a diverging drawn solve would be the
    whole clipped update, so the command warns unless it is detached or off."""
    from timm_odevit_tools.train.command import build_task, jasmin_on_drawn_solvers, parse_args
    guided = ['--model', 'odevit_tiny_patch4_32', '--model-kwargs', 'depth=2', '--teacher', 'dense_vit_tiny_patch4_32',
              '--teacher-kwargs', 'depth=2', 'in_chans=1']

    def warning(*extra: str):
        args = parse_args(guided + list(extra), files=False)
        return jasmin_on_drawn_solvers(args, build_task(args, torch.device('cpu')))

    assert '--jasmin-detach' in warning('--solvers', 'euler:2,rk4:1')
    assert warning('--solvers', 'euler:2,rk4:1', '--jasmin-detach') is None
    assert warning('--solvers', 'euler:2,rk4:1', '--jasmin-weight', '0') is None
    assert warning() is None  # the training grid alone
    alone = parse_args(['--model', 'odevit_tiny_patch4_32', '--solvers', 'euler:2'], files=False)
    assert jasmin_on_drawn_solvers(alone, build_task(alone, torch.device('cpu'))) is None
