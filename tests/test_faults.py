"""Fault injection around the models: Hub endpoints that are down or silent, no Hub at all, a mirror on a busy or
invalid port. Each case runs as a user would (a fresh interpreter, its own Hugging Face cache) and must end at once
with a message that names the problem and a way out that works from where the user stands. No request may leave
the machine: the proxies point at a closed port (loopback bypasses them). Timeouts here are limits that catch a
client retrying for a minute (46-55 s before), not timings."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import slow_except

REPO_ROOT = Path(__file__).resolve().parent.parent
# a child that took longer than this retried: the endpoint check answers within its 2 s timeout
FAST = 30


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith('HF_')}
    env.update(HF_HOME=str(tmp_path / 'hf'), HF_HUB_DISABLE_TELEMETRY='1', HTTPS_PROXY='http://127.0.0.1:9',
               HTTP_PROXY='http://127.0.0.1:9', NO_PROXY='127.0.0.1,localhost', PYTHONPATH=str(REPO_ROOT),
               PYTHONWARNINGS='default')
    env.update(extra)
    return env


def _create(tmp_path: Path, name: str, prelude: str = '', **env: str) -> subprocess.CompletedProcess:
    code = f'import timm, timm_odevit\n{prelude}\nm = timm.create_model({name!r}, pretrained=True)\nprint("loaded")\n'
    return subprocess.run([sys.executable, '-c', code], env=_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=FAST, cwd=tmp_path)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server():
    """A loopback server that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        s.listen(8)
        yield f'http://127.0.0.1:{s.getsockname()[1]}'


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize('kind', slow_except(['closed_port', 'silent_server'], fast=lambda k: k == 'closed_port'))
def test_dead_hub_endpoint_fails_at_once_naming_the_way_out(tmp_path, kind, silent_server):
    endpoint = silent_server if kind == 'silent_server' else f'http://127.0.0.1:{_closed_port()}'
    proc = _create(tmp_path, 'ssog_ode_tiny_patch4_32.fmnist', HF_ENDPOINT=endpoint)
    last = _last_line(proc)
    assert proc.returncode != 0 and last.startswith('RuntimeError'), proc.stderr[-2000:]
    for phrase in (f'HF_ENDPOINT={endpoint} cannot serve', 'python -m timm_odevit_tools.hub serve', 'local-dir:'):
        assert phrase in last, last
    assert ('no answer within 2 s' in last) == (kind == 'silent_server')


# what timm's validate.py does with --model X --pretrained (its create_model call), as a script the launcher runs
VALIDATE_STAND_IN = '''import argparse, timm
p = argparse.ArgumentParser()
p.add_argument('--model')
p.add_argument('--pretrained', action='store_true')
args = p.parse_args()
timm.create_model(args.model, pretrained=args.pretrained)
print('loaded')
'''


def test_dead_hub_endpoint_through_the_launcher_fails_at_once_naming_the_way_out(tmp_path):
    script = tmp_path / 'validate.py'
    script.write_text(VALIDATE_STAND_IN)
    endpoint = f'http://127.0.0.1:{_closed_port()}'
    proc = subprocess.run([sys.executable, '-m', 'timm_odevit.run', str(script), '--model',
                           'ssog_ode_tiny_patch4_32.fmnist', '--pretrained'], env=_env(tmp_path, HF_ENDPOINT=endpoint),
                          capture_output=True, text=True, timeout=FAST, cwd=tmp_path)
    last = _last_line(proc)
    assert proc.returncode != 0 and last.startswith('RuntimeError'), proc.stderr[-2000:]
    port = endpoint.rsplit(':', 1)[1]
    for phrase in (f'HF_ENDPOINT={endpoint} cannot serve', f'python -m timm_odevit_tools.hub serve --port {port}',
                   'local-dir:'):
        assert phrase in last, last


def test_dead_hub_endpoint_with_a_cached_copy_loads_it_and_says_so(tmp_path):
    """The weights came through a mirror once; the mirror is gone now: the cached copy loads, offline, at once."""
    first = _create(tmp_path, 'ssog_ode_tiny_patch4_32.fmnist')  # no endpoint: the checkout's copy, into the cache
    assert first.returncode == 0, first.stderr[-2000:]
    proc = _create(tmp_path, 'ssog_ode_tiny_patch4_32.fmnist', HF_ENDPOINT=f'http://127.0.0.1:{_closed_port()}')
    assert proc.returncode == 0 and 'loaded' in proc.stdout, proc.stderr[-2000:]
    assert 'cannot serve' in proc.stderr and 'loads from the Hugging Face cache' in proc.stderr


@pytest.mark.slow
def test_headline_line_without_any_hub_loads_the_installed_copy_through_the_cache(tmp_path):
    """create_model('ssog_ode_small', pretrained=True) with no HF_ENDPOINT and an empty cache: the weights this
    install carries go into the Hugging Face cache and timm's own Hub loader reads them there; said once; the second
    time the cache alone serves."""
    proc = _create(tmp_path, 'ssog_ode_small')
    assert proc.returncode == 0 and 'loaded' in proc.stdout, proc.stderr[-2000:]
    assert 'not on huggingface.co yet: loading the copy installed with timm_odevit' in proc.stderr
    snapshots = list((tmp_path / 'hf' / 'hub').glob('models--timm-odevit--ssog_ode_small.fmnist_64px/snapshots/*'))
    assert len(snapshots) == 1 and (snapshots[0] / 'model.safetensors').is_file()
    ref = snapshots[0].parent.parent / 'refs' / 'main'
    assert ref.read_text() == snapshots[0].name
    again = _create(tmp_path, 'ssog_ode_small')
    assert again.returncode == 0 and 'loads from the Hugging Face cache' in again.stderr


def test_no_hub_and_no_installed_copy_names_the_way_out(tmp_path):
    proc = _create(tmp_path, 'ssog_ode_tiny_patch4_32.fmnist',
                   prelude='import timm_odevit.models.pretrained as p; p.local_weights_roots = lambda: []')
    last = _last_line(proc)
    assert proc.returncode != 0 and last.startswith('RuntimeError')
    for phrase in ('not on huggingface.co yet', 'python -m timm_odevit_tools.hub serve', 'HF_ENDPOINT', 'local-dir:'):
        assert phrase in last, last


@pytest.mark.parametrize('port,message', [('busy', 'is in use (another mirror?)'), ('99999', 'is not a TCP port')])
def test_mirror_on_a_busy_or_invalid_port_says_so_in_one_line(tmp_path, port, message):
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen(1)
        number = str(taken.getsockname()[1]) if port == 'busy' else port
        proc = subprocess.run([sys.executable, '-m', 'timm_odevit_tools.hub', 'serve', '--port', number,
                               '--duration', '1'],
                              env=_env(tmp_path), capture_output=True, text=True, timeout=FAST, cwd=REPO_ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], proc.stderr


@pytest.mark.parametrize('argv,message', [
    (['--lr=-1'], '--lr must be at least 0, got -1.0'),
    (['--lr', 'nan'], '--lr must be at least 0, got nan'),
    (['--min-lr=-1e-5'], '--min-lr must be at least 0'),
    (['--weight-decay', '-1'], '--weight-decay must be at least 0'),
    (['--warmup-epochs', '-2'], '--warmup-epochs must be at least 0'),
    (['--epochs', '3', '--warmup-epochs', '3'], '--warmup-epochs 3 must be shorter than the run (--epochs 3)'),
    (['--epochs', '0'], '--epochs must be at least 1'),
    (['--batch-size', '0'], '--batch-size must be at least 1'),
    (['--workers', '-1'], '--workers must be at least 0'),
    (['--smoothing', '1'], '--smoothing must be in [0, 1), got 1.0'),
    (['--model-ema-decay', '1'], '--model-ema-decay must be in (0, 1), got 1.0'),
    (['--model-ema-decay', '0'], '--model-ema-decay must be in (0, 1), got 0.0'),
    (['--kd-temperature', '0'], '--kd-temperature must be above 0'),
    (['--clip-grad', 'inf'], None),  # allowed: no clipping in effect, as timm's train.py
    (['--model', 'ssog_od_tiny'], 'did you mean ssog_ode_tiny'),
    (['--distill-end-epoch', '0'], '--distill-end-epoch must be at least 1, got 0'),
    (['--times', 'unifrom'], "--times must be 'uniform', 'paper' or comma-separated numbers"),
    (['--teacher-indices', 'a'], "--teacher-indices must be comma-separated integers"),
    (['--time-indices', '1,x'], "--time-indices must be comma-separated integers (3,6,12), got '1,x'"),
])
def test_training_options_out_of_range_refused_before_any_work(argv, message, capsys):
    from timm_odevit_tools.train.command import parse_args
    if message is None:
        assert parse_args(argv).clip_grad == float('inf')
        return
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_subset_larger_than_its_split_is_refused_naming_the_split_size():
    from timm_odevit_tools.data import SAMPLE_DIR, build_dataset
    with pytest.raises(ValueError, match=r"100000000 samples asked for, but the 'test' split .* holds 1000: ask for "
                                         r'at most 1000'):
        build_dataset('fashion_mnist', SAMPLE_DIR, 'test', num_samples=100_000_000)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_truncated_weights_in_a_local_dir_name_the_folder(tmp_path):
    import shutil
    import timm
    import timm_odevit  # noqa: F401
    folder = tmp_path / 'ssog_ode_tiny_patch4_32.fmnist'
    shutil.copytree(REPO_ROOT / 'weights' / folder.name, folder)
    _truncate(folder / 'model.safetensors')
    with pytest.raises(RuntimeError, match=rf'The pretrained weights in {folder} cannot be read, truncated or '
                                           r'corrupt \(SafetensorError'):
        timm.create_model(f'local-dir:{folder}', pretrained=True)


@pytest.mark.parametrize('option', ['--resume', '--initial-checkpoint', '--teacher-checkpoint'])
@pytest.mark.parametrize('damage', ['truncated', 'flipped_byte', 'not_a_checkpoint'])
def test_damaged_checkpoints_are_refused_before_any_work_naming_the_file(tmp_path, option, damage, capsys):
    import torch
    from timm_odevit_tools.train.command import parse_args
    path = tmp_path / 'checkpoint-0.pth.tar'
    torch.save({'state_dict': {'w': torch.arange(4096.)}, 'epoch': 0}, path)
    if damage == 'truncated':
        _truncate(path)
    elif damage == 'flipped_byte':
        data = bytearray(path.read_bytes())
        at = data.index(torch.arange(4096.).numpy().tobytes()[:64]) + 100  # inside the tensor's bytes
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.write_text('not a checkpoint\n')
    with pytest.raises(SystemExit):
        parse_args([option, str(path)])
    err = capsys.readouterr().err
    assert f'{option} {path}: not a readable checkpoint, truncated or corrupt' in err, err


def _no_space(partial: Path):
    """An OSError as a full disk raises it, after some bytes of ``partial`` were written."""
    import errno
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b'\0' * 100)
    return OSError(errno.ENOSPC, 'No space left on device')


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


def test_full_disk_while_saving_a_checkpoint_names_the_last_good_one_and_resume_succeeds(tmp_path, monkeypatch):
    import torch
    from timm_odevit_tools.data import SAMPLE_DIR
    from timm_odevit_tools.files import WriteFailed
    from timm_odevit_tools.train.command import main
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
    run = tmp_path / 'out' / 'run'
    argv = ['--data-dir', str(SAMPLE_DIR), '--train-split', 'test', '--model', 'ssog_vit_tiny_patch4_32',
            '--model-kwargs', 'depth=2', '--train-samples', '16', '--val-samples', '8', '--batch-size', '8',
            '--max-steps-per-epoch', '1', '--output', str(tmp_path / 'out'), '--experiment', 'run', '--device', 'cpu',
            '--epochs', '2']
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:  # the checkpoint of epoch 1
            raise _no_space(Path(f))
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, 'save', save)
    with pytest.raises(WriteFailed) as e:
        main(argv)
    last = run / 'last.pth.tar'
    assert (f'Saving the checkpoint of epoch 1 in {run} failed (the disk is full; ' in str(e.value)
            and f'The last good checkpoint is {last} (epoch 0): free space, then continue with --resume {last}.'
            in str(e.value)), str(e.value)
    assert not (run / 'tmp.pth.tar').exists()
    before = _snapshot(run)
    monkeypatch.setattr(torch, 'save', real_save)
    resumed = main(argv[:-6] + ['--output', str(tmp_path / 'again'), '--experiment', 'run', '--device', 'cpu',
                                '--epochs', '2', '--resume', str(last)])
    assert resumed['top1'] >= 0 and (tmp_path / 'again' / 'run' / 'checkpoint-1.pth.tar').is_file()
    assert _snapshot(run) == before


def test_full_disk_while_exporting_changes_nothing_and_a_retry_succeeds(tmp_path, monkeypatch):
    import timm
    from timm_odevit_tools.files import WriteFailed
    from timm_odevit_tools.hub import export as ex
    root = tmp_path / 'weights'
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10, in_chans=1)
    ex.export(model, 'ssog_ode_tiny_patch4_32', 'first', str(root))
    before = _snapshot(root)
    real = ex.save_for_hf

    def full(model, folder, **kwargs):
        raise _no_space(Path(folder) / 'model.safetensors')
    monkeypatch.setattr(ex, 'save_for_hf', full)
    for tag in ('first', 'second'):  # over a published folder, and a new one
        with pytest.raises(WriteFailed, match=rf'Exporting ssog_ode_tiny_patch4_32.{tag} in {root} failed \(the '
                                              rf'disk is full; .* Nothing in {root} was changed'):
            ex.export(model, 'ssog_ode_tiny_patch4_32', tag, str(root))
        assert _snapshot(root) == before and sorted(p.name for p in root.iterdir()) == sorted(
            ['MANIFEST.json', 'ssog_ode_tiny_patch4_32.first'])
    monkeypatch.setattr(ex, 'save_for_hf', real)
    assert (ex.export(model, 'ssog_ode_tiny_patch4_32', 'second', str(root)) / 'model.safetensors').is_file()


def test_full_disk_while_building_the_data_cache_changes_nothing_and_a_retry_succeeds(tmp_path, monkeypatch):
    import shutil
    from timm_odevit_tools import data as fm
    from timm_odevit_tools.files import WriteFailed
    root = tmp_path / 'cache'
    (root / 'keep.txt').parent.mkdir(parents=True)
    (root / 'keep.txt').write_text('a file that was there before\n')
    before = _snapshot(root)
    real = shutil.copyfileobj

    def full(fin, fout, *args):
        raise _no_space(Path(fout.name))
    monkeypatch.setattr(fm.shutil, 'copyfileobj', full)
    with pytest.raises(WriteFailed, match=rf'Laying out {fm.SAMPLE_DIR} in {root} failed \(the disk is full; .*'
                                          r'Nothing there was changed'):
        fm.layout_fashion_mnist(fm.SAMPLE_DIR, root)
    assert {k: v for k, v in _snapshot(root).items() if k.name != '.FashionMNIST.lock'} == before
    assert not [p for p in root.iterdir() if p.name.startswith('.FashionMNIST.') and p.is_dir()]
    monkeypatch.setattr(fm.shutil, 'copyfileobj', real)
    assert (fm.layout_fashion_mnist(fm.SAMPLE_DIR, root) / 'FashionMNIST' / 'raw').is_dir()


@pytest.mark.slow
def test_training_killed_at_random_moments_resumes_to_the_uninterrupted_weights(tmp_path):
    """SIGKILL at three seeded random moments of a 3-epoch run, each time resumed from what it left (its last
    checkpoint, or from scratch when it had none): the final weights equal an uninterrupted run's to the bit, and
    results.json lists every epoch once."""
    import json
    import random
    import signal
    import time
    from timm_odevit_tools.data import SAMPLE_DIR
    env = _env(tmp_path, OMP_NUM_THREADS='1', XDG_CACHE_HOME=str(tmp_path / 'cache'))

    def start(folder: str, *extra: str) -> subprocess.Popen:
        argv = ['--data-dir', str(SAMPLE_DIR), '--train-split', 'test', '--model', 'ssog_vit_tiny_patch4_32',
                '--model-kwargs', 'depth=2', '--train-samples', '64', '--val-samples', '16', '--batch-size', '8',
                '--max-steps-per-epoch', '8', '--output', str(tmp_path), '--experiment', folder, '--device', 'cpu',
                '--epochs', '3', '--augment', '--model-ema', '--seed', '3', *extra]
        return subprocess.Popen([sys.executable, '-m', 'timm_odevit_tools.train', *argv], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    whole = start('whole')
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-2000:]
    run = tmp_path / 'killed'
    rng = random.Random(0)
    kills = 0
    while True:
        last = run / 'last.pth.tar'
        proc = start('killed', *(['--resume', str(last)] if last.exists() else []))
        if kills < 3:
            log = run / 'train.log'
            deadline = time.time() + 300
            while not (log.exists() and 'loss' in log.read_text()) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.05)  # killed once training runs: start-up is not the interesting part
            time.sleep(rng.uniform(0, 1.5))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                kills += 1
                continue
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-2000:]
        break
    results = [json.loads((tmp_path / f / 'results.json').read_text()) for f in ('whole', 'killed')]
    assert results[1]['rank_state_sha256'] == results[0]['rank_state_sha256']
    assert [h['epoch'] for h in results[1]['history']] == [0, 1, 2]
    assert kills == 3


def test_an_installed_copy_that_differs_from_its_manifest_never_reaches_the_cache(tmp_path):
    import shutil
    root = tmp_path / 'installed'
    repo = 'ssog_ode_small.fmnist_64px'
    shutil.copytree(REPO_ROOT / 'weights' / repo, root / repo)
    shutil.copy(REPO_ROOT / 'weights' / 'MANIFEST.json', root / 'MANIFEST.json')
    data = bytearray((root / repo / 'model.safetensors').read_bytes())
    data[-1] ^= 0xFF
    (root / repo / 'model.safetensors').write_bytes(bytes(data))
    proc = _create(tmp_path, 'ssog_ode_small', prelude='import pathlib, timm_odevit.models.pretrained as p\n'
                                                       f'p.local_weights_roots = lambda: [pathlib.Path({str(root)!r})]')
    last = _last_line(proc)
    assert proc.returncode != 0 and f'{root / repo / "model.safetensors"} is not the published file' in last, last
    assert not list((tmp_path / 'hf' / 'hub').rglob('model.safetensors'))


def test_mirror_refusal_reason_stays_one_short_line_however_broken_the_repo(tmp_path):
    """Every file of a repo broken at once: the refusal names the requested file's problem first, counts the rest,
    and stays one header line of at most MAX_REASON characters (it was one line per broken file, unbounded)."""
    import shutil
    import urllib.request
    from timm_odevit_tools.hub import MANIFEST_FILE
    from timm_odevit_tools.hub.server import _REFUSAL, MAX_REASON, REFUSED_STATUS, HubMirror
    repo = 'ssog_ode_tiny_patch4_32.fmnist'
    root = tmp_path.joinpath(*['w' * 200] * 4)  # a long path: every problem names it
    shutil.copytree(REPO_ROOT / 'weights' / repo, root / repo)
    shutil.copy(REPO_ROOT / 'weights' / MANIFEST_FILE, root / MANIFEST_FILE)
    for f in (root / repo).iterdir():
        f.write_bytes(f.read_bytes() + b'x')
    with HubMirror(str(root)) as m:
        req = urllib.request.Request(f'{m.url}/timm-odevit/{repo}/resolve/main/model.safetensors', method='HEAD')
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
    reason = e.value.headers['X-Error-Message']
    assert e.value.code == REFUSED_STATUS and '\n' not in reason
    assert len(reason) <= len(_REFUSAL.format(repo=f'timm-odevit/{repo}')) + 1 + MAX_REASON
    assert 'model.safetensors' in reason and 'more problems in this repo' in reason


@pytest.mark.slow
def test_truncated_weights_in_the_hub_cache_name_the_folder_to_remove(tmp_path):
    """A download cut short by something else than huggingface_hub (a full disk under a copy, a crash): the cached
    file is named with the folder to remove, and loading again after removing it works."""
    import shutil
    first = _create(tmp_path, 'ssog_ode_tiny_patch4_32.fmnist')
    assert first.returncode == 0, first.stderr[-2000:]
    repo_cache = tmp_path / 'hf' / 'hub' / 'models--timm-odevit--ssog_ode_tiny_patch4_32.fmnist'
    (weights,) = repo_cache.glob('snapshots/*/model.safetensors')
    _truncate(weights)
    proc = _create(tmp_path, 'ssog_ode_tiny_patch4_32.fmnist')
    last = _last_line(proc)
    assert proc.returncode != 0 and f'The pretrained weights {weights} cannot be read' in last, last
    assert f'remove the folder {repo_cache} and load again' in last
    shutil.rmtree(repo_cache)
    assert _create(tmp_path, 'ssog_ode_tiny_patch4_32.fmnist').returncode == 0
