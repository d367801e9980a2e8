"""tests/tiers.py: the slow marks reach the collected tests with the ids pytest gives bare cases, and the durations
check names the fast tier's tests that break the time rule."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import check, durations, slow_except

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_slow_except_marks_the_other_cases_and_keeps_their_ids():
    cases = slow_except(['tiny', 'base', pytest.param('small', id='s')], fast=lambda m: m == 'tiny')
    assert cases[0] == 'tiny'
    assert [m.name for m in cases[1].marks] == ['slow'] and cases[1].values == ('base',) and cases[1].id is None
    assert [m.name for m in cases[2].marks] == ['slow'] and cases[2].id == 's'
    pairs = slow_except([('a', 1), ('b', 2)], fast=lambda c: c[1] == 1)
    assert pairs[0] == ('a', 1) and pairs[1].values == ('b', 2) and pairs[1].marks[0].name == 'slow'


def test_check_names_fast_tests_over_the_time_rule():
    report = ['============ slowest durations ============',
              '12.00s call     tests/test_a.py::test_models[base]',
              '2.50s setup    tests/test_a.py::test_models[tiny]',
              '0.50s call     tests/test_a.py::test_models[tiny]',
              '30.00s call     tests/test_b.py::test_install',
              '1.00s call     tests/test_b.py::test_quick']
    times = durations(report)
    assert times['tests/test_a.py::test_models[tiny]'] == 3.0 and len(times) == 4
    fast = ['tests/test_a.py::test_models[tiny]', 'tests/test_b.py::test_install', 'tests/test_b.py::test_quick']
    assert check(times, fast, max_case=20) == (['tests/test_b.py::test_install'], 34.0)
    assert check(times, fast[::2], max_case=20) == ([], 4.0)


def test_slow_marks_in_the_files_deselect_their_tests():
    # a whole function marked in its file, and one case of a parametrized test marked by slow_except
    whole = 'tests/test_install.py::test_main_command_runs_from_a_normal_install'
    case = 'tests/test_zoo.py::test_autocast_bf16[dense_vit]'
    kept = 'tests/test_zoo.py::test_autocast_bf16[ssog_ode]'
    r = subprocess.run([sys.executable, '-m', 'pytest', '-n', '0', '--collect-only', '-q', '-p', 'no:cacheprovider',
                        '-m', 'not slow', 'tests/test_install.py', 'tests/test_zoo.py'],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ids = set(r.stdout.split())
    assert whole not in ids and case not in ids and kept in ids, r.stdout[-2000:]


def test_workers_get_whole_files_longest_first_and_split_files_test_by_test():
    """What an xdist worker collects (tests/conftest.py): the files not in SPLIT_FILES as one group each, so their
    documented blocks and module fixtures stay on one worker, and so do a split file's tests that share a unit
    (SHARED_UNITS); the longest units first."""
    files = ['tests/test_doc_commands.py', 'tests/test_tiers.py', 'tests/test_zoo.py', 'tests/test_hub.py']
    r = subprocess.run([sys.executable, '-m', 'pytest', '-n', '0', '--collect-only', '-q', '-p', 'no:cacheprovider',
                        *files], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600,
                       env={**os.environ, 'PYTEST_XDIST_WORKER': 'gw0'})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ids = [line for line in r.stdout.splitlines() if '::' in line]
    order = [f for i, f in enumerate(i.split('::')[0] for i in ids) if i == 0 or ids[i - 1].split('::')[0] != f]
    assert order[0] == 'tests/test_doc_commands.py', order
    # whole files stay together; the split file's slow tests come before the small whole file, its fast ones after
    assert order.count('tests/test_doc_commands.py') == 1 and order.count('tests/test_tiers.py') == 1, order
    assert order.index('tests/test_tiers.py') > order.index('tests/test_zoo.py'), order
    assert ids[-1].startswith(('tests/test_zoo.py::', 'tests/test_hub.py::')), order
    # the published cards' tests share one interpreter (a module fixture): one unit, not spread over the run
    shared = [i for i, t in enumerate(ids) if '::test_card_top1_reproduces_through_mirror[' in t
              or '::test_untagged_name_with_pretrained_loads_the_published_tag' in t]
    assert len(shared) > 2 and shared == list(range(shared[0], shared[-1] + 1)), shared
    assert {i.split('::')[0] for i in ids[:shared[0]]} == {'tests/test_doc_commands.py'}, ids[:shared[0]][-3:]


def test_two_workers_run_each_whole_file_on_one_worker():
    """Under the README's command (two xdist workers) every test of a file that is not split runs on the same worker,
    as the scheduler in tests/conftest.py promises (xdist's own grouping had silently split every file)."""
    files = ['tests/test_layers.py', 'tests/test_integrators.py']
    r = subprocess.run([sys.executable, '-m', 'pytest', '-n', '2', '-v', '-p', 'no:cacheprovider', *files],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ran = re.findall(r'^\[(gw\d+)\] .*?(?:PASSED|SKIPPED|XFAIL) (tests/\S+?)::', r.stdout, flags=re.M)
    workers = {f: {w for w, g in ran if g == f} for f in files}
    assert all(len(w) == 1 for w in workers.values()) and len(ran) > 10, (workers, r.stdout[-2000:])
