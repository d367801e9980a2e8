"""The dependency floors pyproject.toml declares work (issue 61): CI installs the newest of everything, so nothing
else ever runs the package against the oldest versions it claims to support.

A fresh virtual environment (no system site-packages) gets torch and torchvision as CI pins them, exactly (``==``)
each floor that pyproject.toml declares, the tools' dependencies, and then a copy of the checkout (non-editable,
``--no-deps``, so the resolver cannot lift a floor). After checking that the installed versions are the floors,
``tests/floor_smoke.py`` runs in it from an empty folder, offline with an empty HF_HOME: imports, one model of every
family, every ODE method through torchdiffeq, the default published weight, a distillation step and an export.
Needs PyPI (the floors are downloaded).
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from floor_smoke import OK_LINE
from test_install import _NOT_SOURCE, REPO_ROOT, _isolated_env

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip('tomli')

# what the floors run against: the torch CI installs (.ci/run), and the tools' dependencies (their newest)
PINNED = {'torch': '2.14.1', 'torchvision': '0.29.1'}
TOOLS = ('matplotlib', 'tqdm')
# every other dependency must declare a floor
UNFLOORED = {'torch', 'torchvision'}


def declared_floors(pyproject: Path = REPO_ROOT / 'pyproject.toml') -> Dict[str, str]:
    """Distribution name (canonical) -> the version of its ``>=`` specifier, for each of pyproject's dependencies;
    AssertionError for a dependency other than torch and torchvision without exactly one such floor."""
    deps = tomllib.loads(pyproject.read_text())['project']['dependencies']
    floors = {}
    for dep in deps:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        lower = [s.version for s in req.specifier if s.operator == '>=']
        if name in UNFLOORED:
            continue
        assert len(lower) == 1, f'pyproject.toml: {dep!r} declares no single >= floor (issue 61: each is tested)'
        floors[name] = lower[0]
    return floors


@pytest.mark.slow
def test_declared_floors_install_and_work(tmp_path):
    floors = declared_floors()
    assert {'timm', 'torchdiffeq', 'huggingface-hub', 'safetensors'} <= set(floors), floors
    python = tmp_path / 'venv' / 'bin' / 'python'
    subprocess.run([sys.executable, '-m', 'venv', str(tmp_path / 'venv')], check=True, timeout=300)
    # the smoke runs offline (HF_HUB_OFFLINE=1, an empty HF_HOME and cache); pip needs the index
    env = _isolated_env(tmp_path)
    pip_env = {k: v for k, v in env.items() if k != 'PIP_NO_INDEX'}

    def pip(*args: str) -> str:
        r = subprocess.run([str(python), '-m', 'pip', *args], capture_output=True, text=True, timeout=1200,
                           env=pip_env, cwd=str(tmp_path))
        assert r.returncode == 0, f'`pip {" ".join(args)}` failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}'
        return r.stdout

    pinned = [f'{k}=={v}' for k, v in {**PINNED, **floors}.items()]
    pip('install', '--quiet', *pinned, *TOOLS)  # from the index (PyPI)
    # a copy of the tree: an in-tree build would write build/ and *.egg-info into the checkout
    src = tmp_path / 'src'
    shutil.copytree(REPO_ROOT, src, ignore=_NOT_SOURCE)
    pip('install', '--quiet', '--no-deps', str(src))
    shutil.rmtree(src)
    # the resolver lifted nothing: each floor (and torch) is installed exactly, and the set is consistent
    r = subprocess.run([str(python), '-c', 'import json, sys, importlib.metadata as m\n'
                        'print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))', *floors, *PINNED],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    installed = json.loads(r.stdout)
    wanted = {**PINNED, **floors}
    assert {k: Version(v).public for k, v in installed.items()} == wanted, f'installed {installed}, wanted {wanted}'
    assert 'No broken requirements found' in pip('check')

    work = tmp_path / 'elsewhere'  # not the checkout: only the installed copy can be imported
    work.mkdir()
    # -I: neither the script's folder (tests/) nor PYTHON* variables reach sys.path
    r = subprocess.run([str(python), '-I', str(REPO_ROOT / 'tests' / 'floor_smoke.py'), str(tmp_path / 'smoke')],
                       capture_output=True, text=True, timeout=1200, env=env, cwd=str(work))
    out = r.stdout + r.stderr
    assert r.returncode == 0 and OK_LINE in r.stdout, f'the floors {floors} do not work:\n{out[-6000:]}'
    site = next(line for line in r.stdout.splitlines() if line.strip().startswith('timm_odevit from '))
    pkg = Path(site.split(' from ', 1)[1])
    assert tmp_path / 'venv' in pkg.parents and REPO_ROOT not in pkg.parents, f'not the installed copy: {pkg}'
