"""tests/tiers.py chooses the fast tier as docs/testing.md says, and the slow marks reach the collected tests."""
import subprocess
import sys
from pathlib import Path

from tiers import durations, slow_tests

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_fast_tier_keeps_every_functions_cheapest_case_within_the_budget():
    report = ['============ slowest durations ============',
              '12.00s call     tests/test_a.py::test_models[base]',
              '2.50s setup    tests/test_a.py::test_models[tiny]',
              '0.50s call     tests/test_a.py::test_models[tiny]',
              '4.00s call     tests/test_a.py::test_models[small]',
              '30.00s call     tests/test_b.py::test_install',
              '1.00s call     tests/test_b.py::test_quick']
    times = durations(report)
    assert times['tests/test_a.py::test_models[tiny]'] == 3.0 and len(times) == 5
    # budget 8 s: each function's cheapest case first (tiny 3, quick 1), then the cheapest of the rest (small 4);
    # a function whose cheapest case is over the cap (install, 30 s) is slow whole
    assert slow_tests(times, budget=8, max_case=20) == ['tests/test_a.py::test_models[base]',
                                                        'tests/test_b.py::test_install']
    assert slow_tests(times, budget=4, max_case=20) == ['tests/test_a.py::test_models[base]',
                                                        'tests/test_a.py::test_models[small]',
                                                        'tests/test_b.py::test_install']


def test_listed_tests_are_deselected_by_not_slow():
    listed = (REPO_ROOT / 'tests' / 'slow_tests.txt').read_text().split()
    assert listed, 'tests/slow_tests.txt lists no test'
    test = next(t for t in listed if t.startswith('tests/test_') and '[' not in t)
    r = subprocess.run([sys.executable, '-m', 'pytest', '--collect-only', '-q', '-m', 'not slow', test.split('::')[0]],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert r.returncode in (0, 5), r.stdout[-2000:] + r.stderr[-2000:]
    assert test not in r.stdout and 'deselected' in r.stdout, r.stdout[-2000:]
