"""``python -m experiments.study``: run the matched Fashion-MNIST study, report it, measure step elasticity.

    python -m experiments.study run                # resumable; start one per core to share the runs
    python -m experiments.study report             # results.md / results.csv / curves.png
    python -m experiments.study elasticity         # ODE models under other solvers and step counts
    python -m experiments.study export             # best run of each family -> weights/<arch>.fmnist
    python -m experiments.study recipes            # timm train.py YAML recipes -> examples/
    python -m experiments.study guidance --student S --teacher T   # scratch vs teacher-guided, matched
    python -m experiments.study guidance-report    # guidance.md / guidance.csv
    python -m experiments.study guidance-variants --out-dirs A B   # guided-arm variants side by side
"""
import argparse
import logging
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import List, Optional

from .runs import STUDY_PAIRS, StudyRecipe, run_study, study_runs
from timm_odevit_tools.cli import run_command

DEFAULT_OUT = 'results/fmnist_study'
DEFAULT_GUIDANCE_OUT = 'results/guidance'


def _add_run_options(p: argparse.ArgumentParser, out_dir: str) -> argparse.ArgumentParser:
    """What every runner takes: its folder, seeds, threads, data and the recipe's fields."""
    p.add_argument('--out-dir', default=out_dir)
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1])
    p.add_argument('--threads', type=int, default=1, help='threads per training process')
    p.add_argument('--data-dir', default=None, help="Fashion-MNIST IDX files (default: Debian's package)")
    for f in fields(StudyRecipe):
        p.add_argument(f'--{f.name.replace("_", "-")}', type=f.type if callable(f.type) else type(f.default),
                       default=f.default)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog='python -m experiments.study', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True)
    r = _add_run_options(sub.add_parser('run', help='train every run of the study that is not done yet'), DEFAULT_OUT)
    r.add_argument('--settings', nargs='+', default=list(STUDY_PAIRS), choices=list(STUDY_PAIRS))
    rep = sub.add_parser('report', help='results table (mean and spread over seeds), CSV and curves')
    rep.add_argument('--out-dir', default=DEFAULT_OUT)
    el = sub.add_parser('elasticity', help='top-1 of the trained ODE models under other solvers and step counts')
    el.add_argument('--out-dir', default=DEFAULT_OUT)
    el.add_argument('--test-samples', type=int, default=2000, help='first n Fashion-MNIST test images')
    el.add_argument('--solvers', nargs='+', default=None,
                    help='method:steps (default: euler at 3, 6, 12, 23 and 24 steps, rk4 at 3 and 6)')
    ex = sub.add_parser('export', help='export the best run of each family to weights/<arch>.<tag> (one run folder: '
                                       'python -m timm_odevit_tools.hub export <run>/last.pth.tar)')
    ex.add_argument('--out-dir', default=DEFAULT_OUT)
    ex.add_argument('--tag', default=None, help="default: 'fmnist'")
    ex.add_argument('--archs', nargs='+', default=None, help='only these architectures')
    ex.add_argument('--root', default='weights')
    ex.add_argument('--no-full', action='store_true', help='skip the full Fashion-MNIST test set')
    rc = sub.add_parser('recipes', help="write timm train.py YAML recipes (fmnist 32 px, CIFAR-100 224 px)")
    rc.add_argument('--out-dir', default='examples')
    gd = _add_run_options(
        sub.add_parser('guidance', help='train one student from scratch and guided by a teacher, seed by seed'),
        DEFAULT_GUIDANCE_OUT)
    gd.add_argument('--student', default='odevit_tiny_patch4_32')
    gd.add_argument('--model-kwargs', nargs='*', default=[], metavar='K=V', help="the student's, both arms")
    gd.add_argument('--teacher', required=True,
                    help="the training command's teacher options as one string, e.g. 'dense_vit_tiny_patch4_32 "
                         "--teacher-checkpoint weights/dense_vit_tiny_patch4_32.fmnist/model.safetensors "
                         "--teacher-kwargs in_chans=1'")
    gd.add_argument('--guide', default='', help="further options of the guided arm, e.g. '--state-norm layernorm'")
    gd.add_argument('--train-options', default='',
                    help="further training options of both arms, e.g. the published weights' recipe '--augment "
                         "--smoothing 0.1 --model-ema --model-ema-decay 0.999 --torchcompile'")
    gd.add_argument('--no-full-test', action='store_true',
                    help="don't measure each run on the whole test set as it ends (full_test.json, which "
                         "guidance-report --full-test tabulates; the checkpoint it reads is not committed)")
    gr = sub.add_parser('guidance-report', help='scratch vs guided: top-1 and the trajectory against the teacher')
    gr.add_argument('--out-dir', default=DEFAULT_GUIDANCE_OUT)
    gr.add_argument('--test-samples', type=int, default=256, help='first n test images for the trajectory')
    gr.add_argument('--data-dir', default=None, help="Fashion-MNIST IDX files (default: Debian's package)")
    gr.add_argument('--full-test', action='store_true',
                    help='also measure top-1 of each run with a checkpoint on the whole test set (full_test.json)')
    gv = sub.add_parser('guidance-variants', help='guided-arm variants of one comparison side by side, from the logs')
    gv.add_argument('--out-dirs', nargs='+', default=[DEFAULT_GUIDANCE_OUT])
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')

    if a.cmd in ('run', 'guidance'):
        recipe = StudyRecipe(**{f.name: getattr(a, f.name) for f in fields(StudyRecipe)})
        setup = None
        if a.cmd == 'guidance':
            from .guidance import check_teacher, guidance_runs, guidance_setup
            setup = guidance_setup(a.student, a.teacher, a.guide, a.model_kwargs, a.train_options)
            check_teacher(Path(a.out_dir), a.teacher)
            runs = guidance_runs(setup, a.seeds)
        else:
            runs = study_runs(a.seeds, a.settings)
        logging.info('%s in %s: %d runs, recipe %s', a.cmd, a.out_dir, len(runs), asdict(recipe))
        failed = 0
        for i, (run, status) in enumerate(run_study(Path(a.out_dir), runs, recipe, a.threads, a.data_dir, setup)):
            logging.info('[%d/%d] %s: %s', i + 1, len(runs), run.name, status)
            failed += status == 'failed'
            if status == 'trained' and setup is not None and not a.no_full_test:
                from .guidance import record_full_test
                logging.info('%s: full test %s', run.name, record_full_test(Path(a.out_dir) / 'runs' / run.name,
                                                                            setup, a.data_dir))
        return 1 if failed else 0
    if a.cmd == 'guidance-report':
        from .guidance import write_guidance_report
        print(write_guidance_report(Path(a.out_dir), a.test_samples, a.data_dir, a.full_test))
        return 0
    if a.cmd == 'guidance-variants':
        from .guidance import guidance_variants
        print(guidance_variants([Path(d) for d in a.out_dirs]), end='')
        return 0
    if a.cmd == 'report':
        from .report import write_report
        print(write_report(Path(a.out_dir)))
        return 0
    if a.cmd == 'elasticity':
        from .elasticity import ELASTICITY_SOLVERS, write_elasticity
        print(write_elasticity(Path(a.out_dir), a.solvers or ELASTICITY_SOLVERS, a.test_samples))
        return 0
    if a.cmd == 'export':
        import json
        from timm_odevit.models.pretrained import FMNIST_CFG, FMNIST_TAG
        from .export import best_runs, export_run
        runs = best_runs(Path(a.out_dir))
        if not runs:
            p.error(f'no finished runs under {a.out_dir}/runs')
        for arch, run_path in runs.items():
            if a.archs is None or arch in a.archs:
                desc = (f'`{arch}` trained from scratch on Fashion-MNIST at 32 px on a CPU: the best seed of the '
                        'matched study (results/fmnist_study), whose recipe trades data and epochs for CPU time.')
                print(json.dumps(export_run(run_path, a.tag or FMNIST_TAG, FMNIST_CFG, a.root, desc,
                                            not a.no_full)))
        return 0
    if a.cmd == 'recipes':
        from .recipes import write_recipes
        print('\n'.join(str(p) for p in write_recipes(Path(a.out_dir))))
        return 0
    return 2


if __name__ == '__main__':
    sys.exit(run_command(main, 'python -m experiments.study'))
