"""Which tests are slow: ``tests/slow_tests.txt``, from the durations of a full run (docs/testing.md, "Two tiers").

    python -m pytest --durations=0 --durations-min=0 > /tmp/full.log
    python tests/tiers.py /tmp/full.log --out tests/slow_tests.txt

The fast tier (``python -m pytest -m "not slow"``) keeps, within ``BUDGET_S`` seconds of measured test time, the
cheapest case of each test function first, cheapest functions first (so that as many functions as fit, and the
modules they exercise, run in it), and then the cheapest of the rest; every other test is marked slow by
``conftest.py``. A test that the log does not list (a new
one, or one faster than pytest's reporting threshold) stays fast until the list is made again.
"""
import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional

# seconds of measured test time the fast tier may hold: its wall time is about twice that (start-up, collection,
# module fixtures paid by another test than in the full run), 6 to 7 minutes of its 8 on 2 cores
BUDGET_S = 200.0
# a function whose cheapest case takes longer than this is slow as a whole
MAX_CASE_S = 20.0
_LINE = re.compile(r'^\s*(?P<s>[\d.]+)s (?:setup|call|teardown)\s+(?P<id>\S+)')


def durations(lines: Iterable[str]) -> Dict[str, float]:
    """Test id -> seconds (setup, call and teardown added) from the lines of pytest's ``--durations`` report."""
    out: Dict[str, float] = defaultdict(float)
    for line in lines:
        m = _LINE.match(line)
        if m:
            out[m['id']] += float(m['s'])
    return dict(out)


def slow_tests(times: Dict[str, float], budget: float = BUDGET_S, max_case: float = MAX_CASE_S) -> List[str]:
    """The test ids outside the fast tier (see the module's docstring), sorted."""
    by_function: Dict[str, List[str]] = defaultdict(list)
    for test in times:
        by_function[test.split('[')[0]].append(test)
    fast, spent = set(), 0.0
    cheapest = sorted(min(cases, key=times.get) for cases in by_function.values())
    for test in sorted(cheapest, key=times.get):
        if times[test] <= max_case and spent + times[test] <= budget:
            fast.add(test)
            spent += times[test]
    for test in sorted(set(times) - fast, key=times.get):
        if times[test] <= max_case and spent + times[test] <= budget:
            fast.add(test)
            spent += times[test]
    return sorted(set(times) - fast)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog='python tests/tiers.py', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('logs', nargs='+', help='the output of a full run with --durations=0 --durations-min=0 '
                                                  '(several: each test at its longest)')
    parser.add_argument('--out', required=True, help='the list to write, tests/slow_tests.txt')
    args = parser.parse_args(argv)
    times: Dict[str, float] = {}
    for log in args.logs:
        for test, seconds in durations(Path(log).read_text().splitlines()).items():
            # timm's own model tests are slow by conftest.py's rule, whatever they took
            if not test.startswith('tests/timm_suite/'):
                times[test] = max(seconds, times.get(test, 0.0))
    if not times:
        print(f'{" ".join(args.logs)}: no --durations report; run the suite with --durations=0 --durations-min=0',
              file=sys.stderr)
        return 1
    Path(args.out).write_text('\n'.join(slow_tests(times)) + '\n')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
