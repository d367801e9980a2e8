"""``python -m experiments.weights``: the tables and analyses of the published weights, run from a checkout.

- ``table``: Markdown tables rendered from the model cards and the training logs (the README's tables).
- ``elasticity``: top-1 of every published ODE weight under other solvers and step counts.
- ``trajectory``: distance of each guided student and its scratch twin to the teacher's block outputs.
"""
import argparse
import logging
import sys
from pathlib import Path
from typing import List, Optional

from timm_odevit_tools.cli import run_command


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog='python -m experiments.weights', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True)

    t = sub.add_parser('table', help='Markdown tables from the model cards and the training logs: the published '
                                     'weights, SSoG minus dense for pairs trained alike (matched), teacher-guided '
                                     'minus its scratch twin trained alike (guided), dense vs fixed vs steered SSoG '
                                     'runs trained alike (steered), validation top-1 per epoch (curves)')
    t.add_argument('--kind', choices=('weights', 'matched', 'guided', 'steered', 'curves'), default='weights')
    t.add_argument('--root', default='weights')
    t.add_argument('--logs', default='results/weights', help='--kind curves and steered: the folder of training runs')

    el = sub.add_parser('elasticity', help='top-1 of every published ODE weight under other solvers and step counts')
    el.add_argument('--root', default='weights')
    el.add_argument('--out-dir', default='results/weights', help='where elasticity.md, .csv and .png go')
    el.add_argument('--test-samples', type=int, default=2000, help='first n Fashion-MNIST test images')
    el.add_argument('--data-dir', default=None, help="Fashion-MNIST IDX files (default: Debian's package)")
    el.add_argument('--solvers', nargs='+', default=None,
                    help='method:steps (default: euler at 3 to 46 steps, midpoint at 3 to 12, rk4 at 2 to 6, '
                         'and dopri5)')
    el.add_argument('--only', nargs='+', default=None, metavar='REPO',
                    help="measure only these weights (e.g. a re-exported one) and keep the others' rows from the "
                         "last elasticity.csv in --out-dir, which must be at the same solvers and --test-samples")
    el.add_argument('--jobs', type=int, default=1,
                    help="measure this many weights at once, each in its own process with an equal share of torch's "
                         'threads (the rows of one process; 10,000 images took 3.5 core-hours on an AMD EPYC)')
    el.add_argument('--looped-as-ode', action='store_true',
                    help='also solve each published looped weight as its ODE twin (the same parameters; the same '
                         'function at the registered grid)')

    tr = sub.add_parser('trajectory', help="distance of each published guided student and its scratch twin to the "
                                           "teacher's block outputs at the guided card's target times")
    tr.add_argument('--root', default='weights')
    tr.add_argument('--out-dir', default='results/weights', help='where trajectory.md and .csv go')
    tr.add_argument('--test-samples', type=int, default=256, help='first n Fashion-MNIST test images')
    tr.add_argument('--data-dir', default=None, help="Fashion-MNIST IDX files (default: Debian's package)")
    tr.add_argument('--teacher-root', default=None,
                    help="folder where the teacher path a guided record names is found (default: a published "
                         "teacher at the record's revision from the checkout's git history, an unpublished one in "
                         "the working directory)")

    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format='%(message)s')

    if a.cmd == 'table':
        from .tables import guided_table, learning_curves, matched_table, steered_table, weights_table
        tables = {'weights': lambda: weights_table(Path(a.root)), 'matched': lambda: matched_table(Path(a.root)),
                  'guided': lambda: guided_table(Path(a.root)),
                  'steered': lambda: steered_table(Path(a.logs), Path(a.root)),
                  'curves': lambda: learning_curves(Path(a.logs))}
        print(tables[a.kind](), end='')
    elif a.cmd == 'elasticity':
        from .study.elasticity import WEIGHTS_ELASTICITY_SOLVERS, write_weights_elasticity
        print(write_weights_elasticity(Path(a.root), Path(a.out_dir), a.solvers or WEIGHTS_ELASTICITY_SOLVERS,
                                       a.test_samples, a.data_dir, a.only, a.looped_as_ode, a.jobs), end='')
    elif a.cmd == 'trajectory':
        from .study.guidance import write_weights_trajectory
        print(write_weights_trajectory(Path(a.root), Path(a.out_dir), a.test_samples, a.data_dir,
                                       a.teacher_root and Path(a.teacher_root)), end='')
    return 0


if __name__ == '__main__':
    sys.exit(run_command(main, 'python -m experiments.weights'))
