"""Test setup: fetch timm's own model test suite from the timm sdist on PyPI into a cache folder (never into the
checkout, never committed; ``tests/timm_suite/test_timm_models.py`` runs it), and mark the tests outside the fast
tier ``slow`` (timm's own; our slow tests are marked in their files by tests/tiers.py's rule)."""
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# in-process tests import the package pip installed: the checkout's root goes after site-packages, where it serves
# only experiments/ (not installed); `python -m pytest` had put it first (an editable install maps to the checkout)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != str(REPO_ROOT)] + [str(REPO_ROOT)]

TIMM_SUITE_VERSION = '1.0.31'
# where test_timm_models.py finds the fetched file (set by pytest_configure)
SUITE_ENV = 'TIMM_ODEVIT_TIMM_SUITE'

os.environ.setdefault('HF_HUB_DISABLE_TELEMETRY', '1')


def suite_file(version: str = TIMM_SUITE_VERSION) -> Path:
    """``$XDG_CACHE_HOME/timm_odevit/timm_suite/<version>/test_models.py`` (``~/.cache`` without XDG_CACHE_HOME)."""
    cache = Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache')
    return cache / 'timm_odevit' / 'timm_suite' / version / 'test_models.py'


def fetch_timm_suite(dst: Path, version: str = TIMM_SUITE_VERSION) -> Path:
    """Download timm's sdist with pip and extract its tests/test_models.py to ``dst`` (once; atomic)."""
    if dst.is_file():
        return dst
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--no-binary', ':all:',
               f'timm=={version}', '-d', tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(
                f'Could not download the timm {version} sdist for its model tests (needs PyPI access):\n'
                f'{result.stderr}\nDeselect them with --ignore=tests/timm_suite if offline.')
        sdist = next(Path(tmp).glob('timm-*.tar.gz'))
        with tarfile.open(sdist) as tar:
            data = tar.extractfile(tar.getmember(f'timm-{version}/tests/test_models.py')).read()
    dst.parent.mkdir(parents=True, exist_ok=True)
    # write then rename: an interrupted download never leaves a truncated suite behind
    part = dst.with_name(f'{dst.name}.{os.getpid()}.part')
    part.write_bytes(data)
    os.replace(part, dst)
    return dst


def collects_timm_suite(config) -> bool:
    """Whether this session's paths include tests/timm_suite: only then is the suite fetched (a run of other tests
    needs no network, e.g. tests/test_cuda.py on an offline GPU machine)."""
    suite = Path(__file__).resolve().parent / 'timm_suite'
    ignored = [Path(p).resolve() for p in (config.getoption('ignore') or [])]
    if any(p == suite or p in suite.parents for p in ignored):
        return False
    here = Path(config.invocation_params.dir)
    for arg in config.args:
        path = (here / arg.split('::')[0]).resolve()
        if path == suite or path in suite.parents or suite in path.parents:
            return True
    return False


def pytest_configure(config):
    if collects_timm_suite(config):
        os.environ[SUITE_ENV] = str(fetch_timm_suite(suite_file()))


def pytest_collection_modifyitems(config, items):
    # timm's own model tests are slow (tests/tiers.py's rule; the file is fetched, so its tests are marked here); every
    # other slow test carries the mark in its file
    for item in items:
        if item.nodeid.startswith('tests/timm_suite/'):
            item.add_marker(pytest.mark.slow)
