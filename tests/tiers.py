"""The suite's two tiers (docs/testing.md, "Two tiers"): the rule that makes a test slow, the helper that marks the
slow cases of a parametrized test in its file, and a check of a full run's durations against the rule.

A test carries ``@pytest.mark.slow`` in its file when a case of it

- starts an interpreter that does real work (a documented command, a training, export or hub command, timm's
  scripts, torchrun, a fresh virtual environment), or
- takes more than ``MAX_CASE_S`` seconds in a full run on 2 cores (compiling, exporting, scoring published weights).

A parametrized test keeps the cases that exercise its code at least cost in the fast tier and marks the others with
``slow_except``. timm's own model tests are slow by ``conftest.py`` (the file is fetched, not ours to mark).

    python -m pytest --durations=0 --durations-min=0 > /tmp/full.log
    python tests/tiers.py /tmp/full.log

prints the fast tier's tests that break the time rule and the fast tier's measured seconds.
"""
import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pytest

# a case that takes longer than this in a full run on 2 cores is slow
MAX_CASE_S = 20.0
# the fast tier's measured test time should stay under this: its wall time is about 1.5x (start-up, collection,
# module fixtures), within 5 minutes on 2 cores
BUDGET_S = 200.0
_LINE = re.compile(r'^\s*(?P<s>[\d.]+)s (?:setup|call|teardown)\s+(?P<id>\S+)')


def slow_except(cases: Sequence[Any], fast: Callable[[Any], bool]) -> List[Any]:
    """``cases`` for ``pytest.mark.parametrize`` with every case for which ``fast(case)`` is false marked slow (ids as
    pytest would give the bare cases; a case that is already a ``pytest.param`` keeps its own id and marks)."""
    out = []
    for case in cases:
        if isinstance(case, type(pytest.param(None))):
            out.append(case if fast(case.values[0] if len(case.values) == 1 else case.values) else
                       pytest.param(*case.values, id=case.id, marks=[*case.marks, pytest.mark.slow]))
        else:
            out.append(case if fast(case) else pytest.param(*case if isinstance(case, tuple) else (case,),
                                                            marks=pytest.mark.slow))
    return out


def durations(lines: Iterable[str]) -> Dict[str, float]:
    """Test id -> seconds (setup, call and teardown added) from the lines of pytest's ``--durations`` report."""
    out: Dict[str, float] = defaultdict(float)
    for line in lines:
        m = _LINE.match(line)
        if m:
            out[m['id']] += float(m['s'])
    return dict(out)


def fast_tier(paths: Sequence[str] = ('tests',)) -> List[str]:
    """The ids of the fast tier, as ``pytest -m "not slow" --collect-only`` lists them."""
    import subprocess
    r = subprocess.run([sys.executable, '-m', 'pytest', '-n', '0', '-m', 'not slow', '--collect-only', '-q', '-p',
                        'no:cacheprovider', *paths], capture_output=True, text=True)
    return [ln.strip() for ln in r.stdout.splitlines() if '::' in ln]


def check(times: Dict[str, float], fast: Sequence[str], max_case: float = MAX_CASE_S) -> Tuple[List[str], float]:
    """The fast tier's tests that took longer than ``max_case`` (slowest first) and its measured seconds."""
    over = sorted((t for t in fast if times.get(t, 0.0) > max_case), key=lambda t: -times[t])
    return over, sum(times.get(t, 0.0) for t in fast)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog='python tests/tiers.py', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('logs', nargs='+', help='the output of a full run with --durations=0 --durations-min=0 '
                                                  '(several: each test at its longest)')
    args = parser.parse_args(argv)
    times: Dict[str, float] = {}
    for log in args.logs:
        for test, seconds in durations(Path(log).read_text().splitlines()).items():
            times[test] = max(seconds, times.get(test, 0.0))
    if not times:
        print(f'{" ".join(args.logs)}: no --durations report; run the suite with --durations=0 --durations-min=0',
              file=sys.stderr)
        return 1
    over, spent = check(times, fast_tier())
    for test in over:
        print(f'{times[test]:7.1f}s  {test}  (fast tier, over {MAX_CASE_S:.0f} s: mark it slow)')
    print(f'fast tier: {spent:.0f} s of measured test time (budget {BUDGET_S:.0f} s); {len(over)} over '
          f'{MAX_CASE_S:.0f} s')
    return 1 if over or spent > BUDGET_S else 0


if __name__ == '__main__':
    raise SystemExit(main())
