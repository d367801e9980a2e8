"""Test setup: fetch timm's own model test suite from the timm sdist on PyPI into a cache folder (never into the
checkout, never committed; ``tests/timm_suite/test_timm_models.py`` runs it), and mark the tests outside the fast
tier ``slow`` (timm's own; our slow tests are marked in their files by tests/tiers.py's rule)."""
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List

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
    # each of n xdist workers gets its share of the cores (and so do the interpreters its tests start): two workers
    # of two threads each on 2 cores would oversubscribe them
    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT') or 1)
    if workers > 1 and 'OMP_NUM_THREADS' not in os.environ:
        import torch
        os.environ['OMP_NUM_THREADS'] = str(max(1, (os.cpu_count() or 1) // workers))
        torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))
    if collects_timm_suite(config):
        os.environ[SUITE_ENV] = str(fetch_timm_suite(suite_file()))


@pytest.fixture()
def sample_first_100(monkeypatch):
    """Wherever the tools load test images, the bundled sample's first 100: for tests of what a card or record states,
    not of the published figures (tests/test_hub.py's card top-1 through the mirror checks those on all 1,000)."""
    from timm_odevit_tools import data as fm
    load = fm.load_tensors
    monkeypatch.setattr(fm, 'load_tensors', lambda *a, **k: tuple(t[:100] for t in load(*a, **k)))


# pytest-xdist hands out work units (pyproject.toml: `-n 2 --no-loadscope-reorder`), in collection order, the next
# one to whichever worker frees up; the units are ours (pytest_xdist_make_scheduler below). A unit is a whole file, so
# that its module fixtures (mirrors, virtual environments, trained runs) are built once and its documented command
# blocks, some serving on a fixed port, never run beside each other; the files below hold independent tests and are
# split into single tests instead, but for the tests of SHARED_UNITS, which share a costly module fixture.
# (xdist's own `--dist loadgroup` puts a test's `xdist_group` into a nodeid suffix by setting item._nodeid, which
# pytest 9 ignores: every test was a unit of its own, each module fixture built on both workers.)
SPLIT_FILES = ('tests/timm_suite/test_timm_models.py', 'tests/test_zoo.py', 'tests/test_core.py', 'tests/test_hub.py',
               'tests/test_docs.py')
# test (nodeid without its parameters) of a split file -> the unit it shares
SHARED_UNITS = {
    'tests/test_hub.py::test_card_top1_reproduces_through_mirror': 'tests/test_hub.py@mirror_top1',
    'tests/test_hub.py::test_untagged_name_with_pretrained_loads_the_published_tag': 'tests/test_hub.py@mirror_top1',
}


def work_unit(nodeid: str) -> str:
    """The unit a test is scheduled in: its file, or in a split file the test itself or its SHARED_UNITS entry."""
    path = nodeid.split('::')[0]
    if path not in SPLIT_FILES:
        return path
    return SHARED_UNITS.get(nodeid.split('[')[0], nodeid)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


# rough seconds of a test on 2 cores, only to start the longest units first, so that the run does not end on one
# worker's long tail; timm's prune contract runs every tap of the model: minutes for the 23- and 35-layer paper
# configurations at width 768 (docs/testing.md lists a full run's slowest tests)
FAST_S, SLOW_S, PRUNE_S, PAPER_PRUNE_S = 1., 30., 60., 600.


def estimated_seconds(item: pytest.Item) -> float:
    if 'test_prune_intermediate_layers_contract[' in item.nodeid:
        return PAPER_PRUNE_S if '_w768_' in item.nodeid else PRUNE_S
    return SLOW_S if item.get_closest_marker('slow') else FAST_S


def pytest_collection_modifyitems(config, items):
    # timm's own model tests are slow (tests/tiers.py's rule; the file is fetched, so its tests are marked here); every
    # other slow test carries the mark in its file
    for item in items:
        if item.nodeid.startswith('tests/timm_suite/'):
            item.add_marker(pytest.mark.slow)
    if not os.environ.get('PYTEST_XDIST_WORKER'):
        return  # one process: collection order, each file's tests together
    units: Dict[str, List[pytest.Item]] = {}
    for item in items:
        units.setdefault(work_unit(item.nodeid), []).append(item)
    longest_first = sorted(units.values(), key=lambda unit: -sum(map(estimated_seconds, unit)))
    items[:] = [item for unit in longest_first for item in unit]
