"""The main command from a normal (non-editable) install, offline, outside the checkout.

A copy of the source tree is installed with ``pip install --no-deps --no-build-isolation`` into a temporary virtual
environment that sees the testing environment's torch and timm (a ``.pth`` file); ``python -m timm_odevit --sizes tiny``
then runs from an empty folder with a fresh HF_HOME and cache, so nothing of the checkout can be read by accident.
"""
import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from timm_odevit_tools.hub.demo import BUNDLE_DIR, DEFAULT_MODEL, DEFAULT_REPO
from experiments.tables import weight_facts

REPO_ROOT = Path(__file__).resolve().parent.parent
# build outputs and local state that a fresh clone does not have
_NOT_SOURCE = shutil.ignore_patterns('.git', 'build', 'dist', '*.egg-info', '__pycache__', 'venv', '.pytest_cache',
                                     'results', 'output', 'timm_suite')


def _isolated_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(('HF_', 'PYTHON', 'XDG_'))}
    env.update(HF_HOME=str(tmp / 'hf_home'), HF_HUB_OFFLINE='1', HF_HUB_DISABLE_TELEMETRY='1',
               XDG_CACHE_HOME=str(tmp / 'cache'), OMP_NUM_THREADS='1', PIP_NO_INDEX='1')
    return env


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
    """(venv python, isolated env, empty working folder) after a non-editable install of a copy of the tree."""
    tmp = tmp_path_factory.mktemp('install')
    src = tmp / 'src'
    # a copy: an in-tree build would write build/ into the checkout and could pick up stale files from it
    shutil.copytree(REPO_ROOT, src, ignore=_NOT_SOURCE)
    # without its own pip/setuptools: the venv reads those of the environment running the tests, with its torch and
    # timm (torch requires setuptools>=77, which the build needs, see pyproject). Through a .pth file, not
    # --system-site-packages: a venv made from inside a venv would see the base interpreter's packages, which a new
    # machine does not have
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(tmp / 'venv')], check=True, timeout=300)
    python = tmp / 'venv' / 'bin' / 'python'
    env = _isolated_env(tmp)
    r = subprocess.run([str(python), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                       capture_output=True, text=True, check=True, timeout=300, env=env)
    Path(r.stdout.strip(), 'testing_environment.pth').write_text('\n'.join(site.getsitepackages()) + '\n')
    r = subprocess.run([str(python), '-m', 'pip', 'install', '--quiet', '--no-deps', '--no-build-isolation',
                        str(src)], capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    shutil.rmtree(src)  # nothing may be read from the source copy after the install
    work = tmp / 'elsewhere'
    work.mkdir()
    return python, env, work


def _site_package(python: Path, env: dict, cwd: Path) -> Path:
    r = subprocess.run([str(python), '-c', 'import timm_odevit, pathlib; print(pathlib.Path(timm_odevit.__file__)'
                        '.parent)'], capture_output=True, text=True, timeout=300, env=env, cwd=str(cwd))
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def _poison_data_cache(cache: Path) -> None:
    # what an interrupted run can leave in the shared cache: IDX files holding only their 16-byte headers
    for name in ('fashion_mnist', 'fashion_mnist_sample'):
        raw = cache / 'timm_odevit' / 'fashion_mnist' / name / 'FashionMNIST' / 'raw'
        raw.mkdir(parents=True, exist_ok=True)
        (raw / 't10k-images-idx3-ubyte').write_bytes(b'\x00\x00\x08\x03' + (0).to_bytes(4, 'big') + bytes(8))
        (raw / 't10k-labels-idx1-ubyte').write_bytes(b'\x00\x00\x08\x01' + (0).to_bytes(4, 'big'))


@pytest.mark.slow
def test_main_command_runs_from_a_normal_install(installed):
    python, env, work = installed
    pkg = _site_package(python, env, work)
    # a broken shared data cache must not break the first command a user types (issue 14, item 10)
    _poison_data_cache(Path(env['XDG_CACHE_HOME']))
    assert REPO_ROOT not in pkg.parents and 'site-packages' in pkg.parts, f'not the installed copy: {pkg}'
    published = {k.split('/')[0] for k in json.loads((REPO_ROOT / 'weights' / 'MANIFEST.json').read_text())['files']}
    # every published weight ships with the package, so pretrained=True finds each one outside a checkout
    assert sorted(p.name for p in (pkg / BUNDLE_DIR / 'weights').iterdir()) == sorted(['MANIFEST.json', *published])
    r = subprocess.run([str(python), '-m', 'timm_odevit', '--sizes', 'tiny'], capture_output=True, text=True,
                       timeout=900, env=env, cwd=str(work))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f">>> timm.create_model('{DEFAULT_MODEL}', pretrained=True)" in r.stdout
    assert f'Local Hub mirror over {pkg / BUNDLE_DIR / "weights"}' in r.stdout
    # the score the published card states for the sample, reached through the bundled copy
    card = weight_facts(REPO_ROOT / 'weights' / DEFAULT_REPO)
    assert re.search(rf'top-1 on the bundled sample {re.escape(card["sample"])}% \(\d+/1000\)', r.stdout), r.stdout
    assert '| `ssog_ode_tiny` | ssog | ode |' in r.stdout and '_small`' not in r.stdout.split('| model |')[1]
    assert list(work.iterdir()) == [], 'the main command must not write into the working folder'


@pytest.mark.slow
def test_main_command_says_what_is_missing(installed):
    python, env, work = installed
    pkg = _site_package(python, env, work)
    moved = pkg.parent / f'{BUNDLE_DIR}.away'
    (pkg / BUNDLE_DIR).rename(moved)
    try:
        r = subprocess.run([str(python), '-c', 'from timm_odevit_tools.hub.demo import main; raise SystemExit(main())'],
                           capture_output=True, text=True, timeout=300, env=env, cwd=str(work))
    finally:
        moved.rename(pkg / BUNDLE_DIR)
    assert r.returncode == 1
    assert 'missing a weights folder' in r.stdout and 'Fashion-MNIST sample' in r.stdout
    assert 'pip install .' in r.stdout and '--no-demo' in r.stdout


def test_headline_line_loads_offline_in_a_fresh_environment(installed):
    """``timm.create_model('ssog_ode_small', pretrained=True)`` after a normal install, in a fresh interpreter with an
    empty cache, no HF_ENDPOINT and no network (the proxies point at a closed port): the bundled weights go into the
    Hugging Face cache and timm's own Hub loader reads them there, saying where they came from."""
    python, env, work = installed
    env = {k: v for k, v in env.items() if k != 'HF_HUB_OFFLINE'}
    env.update(HTTPS_PROXY='http://127.0.0.1:9', HTTP_PROXY='http://127.0.0.1:9', PYTHONWARNINGS='default')
    code = ("import timm\nm = timm.create_model('ssog_ode_small', pretrained=True)\n"
            "print(m.pretrained_cfg['architecture'], m.pretrained_cfg['tag'])\n")
    r = subprocess.run([str(python), '-c', code], capture_output=True, text=True, timeout=600, env=env, cwd=str(work))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'ssog_ode_small fmnist_64px' in r.stdout
    assert 'loading the copy installed with timm_odevit' in r.stderr and BUNDLE_DIR in r.stderr


def test_every_published_weight_loads_from_a_normal_install_by_each_name(installed):
    """Each published weight by its plain name, its tag and its hf-hub: name, offline with an empty cache, from the
    copies the wheel carries; a name that is not published fails at once, naming what is."""
    python, env, work = installed
    env = {k: v for k, v in env.items() if k != 'HF_HUB_OFFLINE'}
    env.update(HTTPS_PROXY='http://127.0.0.1:9', HTTP_PROXY='http://127.0.0.1:9')
    published = sorted({k.split('/')[0] for k in json.loads((REPO_ROOT / 'weights' / 'MANIFEST.json').read_text())[
        'files']})
    code = ("import sys, time, warnings, timm, torch\nwarnings.simplefilter('ignore')\n"
            "for repo in sys.argv[1:]:\n"
            "    arch = repo.split('.')[0]\n"
            "    names = (repo, 'hf-hub:timm-odevit/' + repo)\n"
            "    models = [timm.create_model(n, pretrained=True).eval() for n in names]\n"
            "    if timm.list_pretrained(arch + '.*')[0] == repo:\n"
            "        models.append(timm.create_model(arch, pretrained=True).eval())\n"
            "    x = torch.randn(1, *models[0].pretrained_cfg['input_size'])\n"
            "    with torch.no_grad():\n"
            "        assert all(torch.equal(models[0](x), m(x)) for m in models[1:]), repo\n"
            "    assert timm.is_model_pretrained(arch), arch\n"
            "    print(repo, len(models))\n"
            "t = time.time()\n"
            "try:\n"
            "    timm.create_model('hf-hub:timm-odevit/ssog_vit_small.nothing', pretrained=True)\n"
            "except RuntimeError as e:\n"
            "    print('REFUSED', round(time.time() - t, 1), e)\n")
    r = subprocess.run([str(python), '-c', code, *published], capture_output=True, text=True, timeout=900, env=env,
                       cwd=str(work))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [line.split()[0] for line in r.stdout.splitlines()[:-1]] == published, r.stdout
    refused = r.stdout.splitlines()[-1]
    assert refused.startswith('REFUSED') and float(refused.split()[1]) < 5, refused
    assert 'The weights this install carries: ' + ', '.join(published) in refused, refused


def test_bundle_folder_is_named_alike_where_it_is_written_and_read():
    """setup.py copies the bundled weights into hub.demo.BUNDLE_DIR; pretrained=True looks in models.pretrained's."""
    from timm_odevit.models import pretrained
    assert pretrained.BUNDLE_DIR == BUNDLE_DIR
