"""Teacher guidance against training alone, matched: one student, one recipe and one seed set, trained from scratch
and guided by a teacher (``python -m timm_odevit_tools.train --teacher``), and the report that compares them.

Runs go through the study's resumable runner (``run_study``): ``runs/<student>-scratch-seed<k>`` and
``runs/<student>-guided-seed<k>``; ``study.json`` records the recipe and the guidance setup, and a folder made with
another one is refused. The report (``guidance.md``, ``guidance.csv``) gives final top-1 per arm (mean and sample SD
over seeds), the gain paired by seed next to ODE-ViT's, and the trajectory: per target time, the distance between
the student's state and the teacher's block output on test images, for both arms, so a reader sees whether guidance
moved the trajectory at all. With ``full_test`` it adds top-1 of each run's last-epoch weights on the whole test set,
on the training grid and at the registered solver (cached per run in ``full_test.json``, as checkpoints are not
committed; the runner writes it as each run ends).
"""
import argparse
import csv
import json
import shlex
import statistics
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from timm_odevit.layers import SOLVER_OPTIONS
from ..paper import PAPER_GUIDANCE_GAIN
from .report import mean_sd
from .runs import RUN_OPTIONS, Run, StudyRecipe

__all__ = ['ARMS', 'check_teacher', 'guidance_report', 'guidance_setup', 'guidance_runs', 'guidance_variants',
           'read_trajectory', 'record_full_test', 'teacher_checkpoint', 'trajectory_table', 'write_guidance_report',
           'write_weights_trajectory']

ARMS = ('scratch', 'guided')
# the trajectory is compared scale-free (1 - cosine of CLS states): raw states of teacher and student differ in norm
TRAJECTORY_NORM = 'cosine'
# the published students' trajectory: in the teacher's basis, and as relations between images (blind to a basis)
WEIGHTS_TRAJECTORY_NORMS = ('cosine', 'gram')
# model kwargs that choose how an ODE trunk is solved, not what it is (what set_solver takes): left out to build
# the registered solver
SOLVER_KWARGS = tuple(f'ode_{name}' for name in SOLVER_OPTIONS)
FULL_TEST_FILE = 'full_test.json'


def guidance_setup(student: str, teacher: str, guide: str = '', model_kwargs: Sequence[str] = (),
                   train_options: str = '') -> Dict[str, Any]:
    """What the runs of one comparison share besides the recipe: the student, its model kwargs, the teacher
    options of the guided arm (``teacher``: the training command's ``--teacher ...`` options as one string, e.g.
    ``'dense_vit_tiny_patch4_32 --teacher-checkpoint weights/.../model.safetensors'``), further guided-arm
    options (``guide``, e.g. ``'--state-norm layernorm'``) and training options of both arms beyond the recipe
    (``train_options``, e.g. ``'--augment --smoothing 0.1 --model-ema --torchcompile'``: the published weights'
    recipe). Options that the recipe, the runner or an arm sets are refused in ``train_options``."""
    if not teacher.strip():
        raise ValueError('A guidance comparison needs a teacher (the --teacher value of the training command).')
    setup = {'student': student, 'model_kwargs': list(model_kwargs), 'teacher': teacher, 'guide': guide}
    if train_options.strip():
        _check_train_options(train_options)
        setup['train_options'] = train_options  # only when given: a study.json written before keeps matching
    return setup


def _check_train_options(options: str) -> None:
    from timm_odevit_tools.train.command import distillation_options, parse_args
    base: List[str] = []  # the parser's default model: the options are checked, not the model
    try:
        given = vars(parse_args(base + shlex.split(options)))
    except SystemExit as e:  # argparse has printed what is wrong
        raise ValueError(f'--train-options {options!r} is not an option list of '
                         'python -m timm_odevit_tools.train.') from e
    # resolved through the parser, so an abbreviation (--epo 3) is caught as well
    changed = {k for k, v in vars(parse_args(base)).items() if given[k] != v}
    taken = changed & ({f.name for f in fields(StudyRecipe)} | set(RUN_OPTIONS) | set(distillation_options()))
    if taken:
        raise ValueError(f'--train-options {options!r} sets {sorted(taken)}, which the recipe, the runner or an arm '
                         'sets: give recipe fields as their own options, teacher options in --teacher / --guide.')


def guidance_runs(setup: Dict[str, Any], seeds: Sequence[int] = (0, 1)) -> List[Run]:
    """Seed-major: both arms of a seed before the next seed, so a comparison cut short keeps complete pairs."""
    shared = tuple(shlex.split(setup.get('train_options', '')))
    guided = ('--teacher', *shlex.split(setup['teacher']), *shlex.split(setup['guide']))
    return [Run('guidance', setup['student'], seed, tuple(setup['model_kwargs']), arm,
                shared + (guided if arm == 'guided' else ()))
            for seed in seeds for arm in ARMS]


def _finished(root: Path, arm: str) -> Dict[int, Path]:
    out = {}
    for path in sorted((Path(root) / 'runs').glob(f'*-{arm}-seed*')):
        if (path / 'results.json').is_file():
            out[int(path.name.rsplit('seed', 1)[1])] = path
    return out


def _teacher_hashes(root: Path) -> Dict[int, str]:
    """Per seed, the sha256 of the teacher checkpoint each finished guided run under ``root`` loaded (recorded in its
    results.json; runs from before that record are left out)."""
    hashes = {}
    for seed, path in _finished(root, 'guided').items():
        recorded = json.loads((path / 'results.json').read_text()).get('teacher_checkpoint_sha256')
        if recorded:
            hashes[seed] = recorded
    return hashes


def teacher_checkpoint(teacher: str) -> Optional[Path]:
    """The file the guided arm's ``--teacher-checkpoint`` names in a ``teacher`` option string, if it names one."""
    args = shlex.split(teacher)
    for i, arg in enumerate(args):
        if arg.startswith('--teacher-checkpoint='):
            return Path(arg.split('=', 1)[1])
        if arg == '--teacher-checkpoint' and i + 1 < len(args):
            return Path(args[i + 1])
    return None


def check_teacher(root: Path, teacher: str) -> None:
    """Refuse to guide more runs under ``root`` by another teacher than its finished guided runs had.

    A comparison names its teacher by path, and a path can come to hold another weight (a published weight trained
    further in place): runs guided by the old and the new file would average into one row. The finished runs'
    recorded hashes are the reference; a teacher that is not a local file (a Hub name) is not checked."""
    path = teacher_checkpoint(teacher)
    if path is not None:
        _check_teacher_file(Path(root), path)


def _check_teacher_file(root: Path, path: Path) -> None:
    hashes = _teacher_hashes(root)
    if not path.is_file() or not hashes:
        return
    from timm_odevit_tools.hub.verify import sha256_file
    now = sha256_file(path)
    other = {seed: h for seed, h in hashes.items() if h != now}
    if other:
        raise ValueError(f'{path} (sha256 {now[:12]}...) is not the teacher the finished guided runs under {root} were '
                         f'given (seed {min(other)}: sha256 {other[min(other)][:12]}...): the file has changed since. '
                         'Restore that teacher file, or guide new runs in another --out-dir.')


def _top1(root: Path) -> Dict[str, Dict[int, float]]:
    """Final top-1 per arm and seed of the finished runs under ``root`` (from their committed results.json)."""
    return {arm: {seed: json.loads((path / 'results.json').read_text())['top1']
                  for seed, path in _finished(root, arm).items()} for arm in ARMS}


def _paired_gains(top1: Dict[str, Dict[int, float]]) -> List[float]:
    """Guided minus scratch top-1 for each seed that both arms finished."""
    return [top1['guided'][k] - top1['scratch'][k] for k in sorted(set(top1['guided']) & set(top1['scratch']))]


def guidance_variants(roots: Sequence[Path]) -> str:
    """Markdown: one row per guidance comparison folder (same student, teacher and recipe, another guided arm), read
    from the committed logs alone: guided-arm options, top-1 per arm, the gain paired by seed.

    A folder whose student, teacher or recipe differs from the first one's is refused (ValueError): the rows must
    differ in the guided arm only. The teacher is compared by name and, where the guided runs recorded it, by the
    hash of the checkpoint they loaded, so one path holding two weights over time does not pass for one teacher."""
    lines = ['| guided-arm options | scratch top-1 | guided top-1 | gain (points, paired) | seeds |',
             '|---|---:|---:|---:|---:|']
    first = None
    for root in map(Path, roots):
        meta = json.loads((root / 'study.json').read_text())
        setup = {k: v for k, v in meta.get('setup', {}).items() if k != 'guide'}
        hashes = set(_teacher_hashes(root).values())
        if first is None:
            first, first_hashes = (setup, meta.get('recipe')), hashes
        elif (setup, meta.get('recipe')) != first or hashes != first_hashes:
            raise ValueError(f'{root} was run with another student, teacher or recipe than {roots[0]}: its row would '
                             'not compare guided arms alone; report it on its own with guidance-report.')
        top1 = _top1(root)
        paired = _paired_gains(top1)
        lines.append(f'| `{meta["setup"].get("guide") or "(defaults)"}` | {mean_sd(list(top1["scratch"].values()))} | '
                     f'{mean_sd(list(top1["guided"].values()))} | {mean_sd(paired)} | {len(paired)} |')
    return '\n'.join(lines) + '\n'


def _images_as_trained(args: argparse.Namespace, student: torch.nn.Module, data_dir: Optional[str],
                       test_samples: int) -> torch.Tensor:
    """The first ``test_samples`` test images, preprocessed as the training command ``args`` fed them."""
    from timm.data import resolve_data_config
    from timm_odevit_tools import data as fm
    from timm_odevit_tools.train.command import input_stats
    data_cfg = resolve_data_config({}, model=student)
    data_cfg['input_size'] = (args.in_chans, *student.patch_embed.img_size)
    mean, std = input_stats(args, data_cfg)
    images, _ = fm.load_tensors(data_dir, 'test', model=student, limit=test_samples,
                                input_size=data_cfg['input_size'], mean=mean, std=std)
    return images


def _committed_trajectory(root: Path) -> Dict[str, Any]:
    """The trajectory ``guidance.csv`` holds: the target times, and per (arm, seed) the gaps and the number of test
    images they were measured on; empty without the file. Columns: arm, seed, top1, images, gap_t<time>..."""
    path = root / 'guidance.csv'
    if not path.is_file():
        return {}
    with open(path, newline='') as f:
        rows = list(csv.reader(f))
    if rows[0][:4] != ['arm', 'seed', 'top1', 'images']:
        raise ValueError(f'{path} does not start with the columns arm, seed, top1, images: measure it again with '
                         f'`python -m experiments.study guidance-report --out-dir {root}` where the checkpoints are.')
    # written rounded to 3 decimals, as the report rounds the times it reads from a checkpoint
    times = [float(c[len('gap_t'):]) for c in rows[0][4:]]
    measured = [r for r in rows[1:] if r[4:]]
    return {'times': times, 'gaps': {(r[0], int(r[1])): [float(v) for v in r[4:]] for r in measured},
            'images': {(r[0], int(r[1])): int(r[3]) for r in measured}}


def _trajectory(root: Path, runs: Dict[str, Dict[int, Path]], data_dir: Optional[str],
                test_samples: int) -> Dict[str, Any]:
    """Per arm and seed, the student's distance to the teacher at each target time of the guided run (its
    calibrated times, so both arms are read at the same depths), with the teacher the guided run was given, on
    test images preprocessed as the training command does.

    Checkpoints are not committed: a run whose checkpoint is gone keeps the gaps an earlier report wrote to
    ``guidance.csv`` (same times, with the number of images they were measured on), and a run with neither is left
    out of the trajectory (the report names it). Returns ``times``, and per arm and seed ``gaps`` and ``images``."""
    from timm.models import load_state_dict
    from timm_odevit_tools.train import read_checkpoint
    from timm_odevit_tools.train.command import build_task
    committed = _committed_trajectory(root)
    with_ckpt = {arm: {seed: p for seed, p in by_seed.items() if (p / 'last.pth.tar').is_file()}
                 for arm, by_seed in runs.items()}
    gaps: Dict[str, Dict[int, List[float]]] = {arm: {} for arm in runs}
    counts: Dict[str, Dict[int, int]] = {arm: {} for arm in runs}
    if with_ckpt['guided']:
        ckpt = read_checkpoint(str(next(iter(with_ckpt['guided'].values())) / 'last.pth.tar'))
        args = ckpt['args']
        if args.teacher_checkpoint:  # the distance to another teacher than the runs had would mean nothing
            _check_teacher_file(root, Path(args.teacher_checkpoint))
        task = build_task(args, torch.device('cpu'))
        task.load_task_state(ckpt.get('task_state'))
        task.eval()
        student = task.get_eval_model()
        images = _images_as_trained(args, student, data_dir, test_samples)
        times = [round(float(t), 3) for t in task.target_times]
        for arm, by_seed in with_ckpt.items():
            for seed, path in by_seed.items():
                # the weights results.json's top-1 was measured on, not an EMA
                with torch.serialization.safe_globals([argparse.Namespace]):
                    student.load_state_dict(load_state_dict(str(path / 'last.pth.tar'), use_ema=False))
                gaps[arm][seed] = task.state_gaps(images, TRAJECTORY_NORM).tolist()
                counts[arm][seed] = len(images)
    elif committed:
        times = committed['times']
    else:
        raise FileNotFoundError(f'{root / "runs"} has no guided checkpoint (last.pth.tar) and {root / "guidance.csv"} '
                                'no committed trajectory: train a guided run again (move its folder out of runs/ and '
                                'run the same `python -m experiments.study guidance` command: it retrains the runs '
                                'that are missing).')
    same_times = bool(committed) and committed['times'] == times
    for arm, by_seed in runs.items():
        for seed in sorted(set(by_seed) - set(with_ckpt[arm])):
            if same_times and (arm, seed) in committed['gaps']:
                gaps[arm][seed] = committed['gaps'][arm, seed]
                counts[arm][seed] = committed['images'][arm, seed]
    for arm in runs:
        if not gaps[arm]:
            raise FileNotFoundError(f'No {arm} run under {root / "runs"} has a checkpoint or a committed trajectory '
                                    'in guidance.csv: move one of its run folders out of runs/ and run the same '
                                    '`python -m experiments.study guidance` command again (it retrains the missing '
                                    'runs).')
    return {'times': times, 'gaps': gaps, 'images': counts}


def _measure_full_test(run: Path, setup: Dict[str, Any], data_dir: Optional[str],
                       loaded: Dict[str, Any]) -> Dict[str, Any]:
    """Top-1 of the run's last-epoch weights (not an EMA: the weights results.json's top-1 was measured on) on the
    whole test split of ``data_dir``: at the registered solver, and on the training grid when the run's model kwargs
    chose another one. ``loaded`` keeps the test images between runs (the arms share preprocessing)."""
    from timm_odevit_tools import data as fm
    from timm_odevit_tools.evaluate import evaluate_solved
    from timm_odevit.models.pretrained import fmnist_input
    from timm_odevit_tools.train import model_from_checkpoint
    from timm_odevit_tools.train.command import parse_args
    kwargs = parse_args(['--model', setup['student'], '--model-kwargs', *setup['model_kwargs']]).model_kwargs
    solver = {k[len('ode_'):]: v for k, v in kwargs.items() if k in SOLVER_KWARGS}
    model = model_from_checkpoint(str(run / 'last.pth.tar'), setup['student'],
                                  pretrained_cfg=fmnist_input(kwargs.get('img_size')),
                                  **{k: v for k, v in kwargs.items() if k not in SOLVER_KWARGS})
    if 'images' not in loaded:
        loaded['images'] = fm.load_tensors(data_dir, 'test', model=model)
    r = evaluate_solved(model, loaded['images'], solver)
    out = {'images': r['registered']['n']}
    for key, name in (('registered', 'registered'), ('solver', 'grid')):
        if key in r:
            out[name] = {'solver': r[key]['solver'], 'top1': round(r[key]['top1'], 2)}
    return out


def record_full_test(run: Path, setup: Dict[str, Any], data_dir: Optional[str] = None,
                     loaded: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Measure a finished run's last-epoch weights on the whole test split of ``data_dir`` and write them to the
    run's ``full_test.json``; returns what was written. The guidance runner calls it as each run ends, while the
    checkpoint (not committed) is still on the machine."""
    out = _measure_full_test(Path(run), setup, data_dir, {} if loaded is None else loaded)
    (Path(run) / FULL_TEST_FILE).write_text(json.dumps(out, indent=2) + '\n')
    return out


def _full_test(runs: Dict[str, Dict[int, Path]], setup: Dict[str, Any], data_dir: Optional[str],
               measure: bool) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """Per arm and seed, the full-test top-1 a run's ``full_test.json`` holds; with ``measure``, runs without one
    and with a checkpoint are measured first (and the file written)."""
    out: Dict[str, Dict[int, Dict[str, Any]]] = {arm: {} for arm in runs}
    loaded: Dict[str, Any] = {}
    for arm, by_seed in runs.items():
        for seed, path in by_seed.items():
            cached = path / FULL_TEST_FILE
            if measure and not cached.is_file() and (path / 'last.pth.tar').is_file():
                record_full_test(path, setup, data_dir, loaded)
            if cached.is_file():
                out[arm][seed] = json.loads(cached.read_text())
    return out


def _full_test_table(tests: Dict[str, Dict[int, Dict[str, Any]]]) -> List[str]:
    """Markdown lines: per seed with both arms measured, top-1 per arm and the gain on the training grid and at the
    registered solver, then mean ± SD over those seeds; no lines when no seed has both."""
    seeds = sorted(set(tests['scratch']) & set(tests['guided']))
    if not seeds:
        return []
    measured = [tests[arm][k] for arm in ARMS for k in seeds]
    keys = [key for key in ('grid', 'registered') if key in measured[0]]
    alike = {(m['images'], *(m[key]['solver'] if key in m else None for key in ('grid', 'registered')))
             for m in measured}
    if len(alike) > 1:
        raise ValueError(f'The runs\' {FULL_TEST_FILE} files differ in images or solvers '
                         f'({sorted(map(str, alike))}): with every run\'s last.pth.tar present, delete them and '
                         'measure all runs alike (guidance-report --full-test); without the checkpoints, keep them.')
    label = {'grid': 'training grid', 'registered': 'registered'}
    head = []
    for key in keys:
        solved = f'{measured[0][key]["solver"]} ({label[key]})'
        head += [f'scratch, {solved}', f'guided, {solved}', 'gain (points)']
    lines = ['', f'Top-1 on the whole test set ({measured[0]["images"]:,} images), last-epoch weights of each run '
                 '(not the EMA), per seed; gain = guided minus scratch:', '',
             '| seed | ' + ' | '.join(head) + ' |', '|---:|' + '---:|' * len(head)]
    cols: List[List[float]] = [[] for _ in head]
    for k in seeds:
        cells = []
        for key in keys:
            s, g = tests['scratch'][k][key]['top1'], tests['guided'][k][key]['top1']
            cells += [s, g, g - s]
        for col, v in zip(cols, cells):
            col.append(v)
        lines.append(f'| {k} | ' + ' | '.join(f'{v:+.2f}' if i % 3 == 2 else f'{v:.2f}' for i, v in enumerate(cells))
                     + ' |')
    lines.append('| mean ± SD | ' + ' | '.join(mean_sd(col) for col in cols) + ' |')
    return lines


def write_guidance_report(root: Path, test_samples: int = 256, data_dir: Optional[str] = None,
                          full_test: bool = False) -> str:
    """Measure a comparison folder and write its data and its report: ``guidance.csv`` (per run: top-1, the images
    and the trajectory's gaps) and ``guidance.md`` (``guidance_report``, rendered from the data alone); returns the
    Markdown. The trajectory is read on the first ``test_samples`` test images of ``data_dir`` (default: Debian's
    Fashion-MNIST, else the sample). With ``full_test``, runs with a checkpoint and no ``full_test.json`` are
    measured on the whole test split of ``data_dir``; the table of full-test top-1 shows every seed whose two runs
    have that file."""
    root = Path(root)
    runs = _both_arms(root)
    setup = json.loads((root / 'study.json').read_text()).get('setup', {})
    traj = _trajectory(root, runs, data_dir, test_samples)
    _full_test(runs, setup, data_dir, full_test)
    top1 = _top1(root)
    with open(root / 'guidance.csv', 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['arm', 'seed', 'top1', 'images'] + [f'gap_t{t}' for t in traj['times']])
        for arm in ARMS:
            for seed in sorted(top1[arm]):
                gaps = traj['gaps'][arm].get(seed)
                w.writerow([arm, seed, round(top1[arm][seed], 2)]
                           + ([traj['images'][arm][seed]] + [round(g, 4) for g in gaps] if gaps else []))
    table = guidance_report(root)
    (root / 'guidance.md').write_text(table)
    return table


def _both_arms(root: Path) -> Dict[str, Dict[int, Path]]:
    runs = {arm: _finished(root, arm) for arm in ARMS}
    if not runs['scratch'] or not runs['guided']:
        raise FileNotFoundError(f'{root / "runs"} needs finished runs of both arms (scratch and guided): '
                                f'run `python -m experiments.study guidance --out-dir {root} --teacher ...` first.')
    return runs


def guidance_report(root: Path) -> str:
    """``guidance.md`` of a comparison folder, from its committed data alone (no checkpoint, no model): the recipe
    and setup (``study.json``), each run's ``results.json`` (top-1, minutes) and ``full_test.json``, and the
    trajectory in ``guidance.csv`` (``write_guidance_report`` measures it). Runs the csv holds no trajectory for are
    named in the line above the trajectory table."""
    root = Path(root)
    runs = _both_arms(root)
    meta = json.loads((root / 'study.json').read_text())
    setup, recipe = meta.get('setup', {}), meta.get('recipe', {})
    results = {arm: {seed: json.loads((p / 'results.json').read_text()) for seed, p in by_seed.items()}
               for arm, by_seed in runs.items()}
    top1 = _top1(root)
    # the budget is matched in images; the guided arm also pays for the teacher's forward
    minutes = {arm: statistics.mean(sum(h['train_seconds'] for h in r['history']) / 60 for r in by_seed.values())
               for arm, by_seed in results.items()}
    traj = _committed_trajectory(root)
    if not traj:
        raise FileNotFoundError(f'{root / "guidance.csv"} is missing: measure the trajectory with `python -m '
                                f'experiments.study guidance-report --out-dir {root}` where the checkpoints are.')
    gaps = {arm: {seed: traj['gaps'][arm, seed] for seed in runs[arm] if (arm, seed) in traj['gaps']} for arm in ARMS}
    missing = [f'{arm} seed {seed}' for arm in ARMS for seed in sorted(runs[arm]) if seed not in gaps[arm]]
    images = ' / '.join(str(n) for n in sorted({traj['images'][key] for key in traj['images']}))
    paired = _paired_gains(top1)
    gain = statistics.mean(paired) if paired else float('nan')
    lines = [
        '| student | teacher | scratch top-1 | guided top-1 | gain (points, paired) | paper gain | seeds | '
        'training min per run, scratch / guided |',
        '|---|---|---:|---:|---:|---:|---:|---:|',
        f'| `{setup.get("student", "?")}` | `{setup.get("teacher", "?")}` | '
        f'{mean_sd(list(top1["scratch"].values()))} | {mean_sd(list(top1["guided"].values()))} | '
        f'{mean_sd(paired)} | > +{PAPER_GUIDANCE_GAIN:g} | {len(paired)} | '
        f'{minutes["scratch"]:.1f} / {minutes["guided"]:.1f} |',
        '',
        f'Trajectory: 1 - cosine similarity of the student\'s CLS state at each target time and the teacher\'s block '
        f'output, on the first {images} test images (mean over seeds; 0 = aligned, 1 = orthogonal)'
        + (f'; without {", ".join(missing)} (no trajectory measured)' if missing else '') + ':',
        '',
        '| arm | ' + ' | '.join(f't = {t:g}' for t in traj['times']) + ' |',
        '|---|' + '---:|' * len(traj['times']),
    ]
    for arm in ARMS:
        lines.append(f'| {arm} | ' + ' | '.join(f'{statistics.mean(col):.3f}' for col in zip(*gaps[arm].values()))
                     + ' |')
    shared = f'; both arms\' further options: `{setup["train_options"]}`' if setup.get('train_options') else ''
    lines += ['', f'Final-epoch top-1 on {recipe.get("val_samples", "?")} Fashion-MNIST test images, mean ± sample SD '
                  f'over seeds; gain = guided minus scratch, paired by seed ({gain:+.2f} points). Recipe: {recipe}; '
                  f'model kwargs: {setup.get("model_kwargs")}; '
                  f'guided-arm options: `{setup.get("guide") or "-"}`{shared}.']
    lines += _full_test_table(_full_test(runs, setup, None, False))
    return '\n'.join(lines) + '\n'


def read_trajectory(path: Path) -> List[Dict[str, Any]]:
    """The rows of a trajectory.csv (one per student, distance and target time), numbers as numbers."""
    with open(path, newline='') as f:
        return [{**r, 'images': int(r['images']), 'time': float(r['time']), 'gap': float(r['gap'])}
                for r in csv.DictReader(f)]


def trajectory_table(rows: Sequence[Dict[str, Any]]) -> str:
    """trajectory.md from the rows of trajectory.csv (``read_trajectory``): one line per student weights and
    distance, a header per set of target times."""
    lines: List[str] = []
    times_before = None
    for key in dict.fromkeys((r['student'], r['teacher'], r['weights'], r['distance']) for r in rows):
        own = [r for r in rows if (r['student'], r['teacher'], r['weights'], r['distance']) == key]
        times = [r['time'] for r in own]
        if times != times_before:
            lines += ([''] if lines else []) + [
                '| student | teacher | weights | distance | ' + ' | '.join(f't = {t:g}' for t in times) + ' |',
                '|---|---|---|---|' + '---:|' * len(times)]
            times_before = times
        lines.append(f'| `{key[0]}` | `{key[1]}` | `{key[2]}` | {key[3]} | '
                     + ' | '.join(f'{r["gap"]:.3f}' for r in own) + ' |')
    images = ' / '.join(map(str, sorted({r['images'] for r in rows})))
    lines += ['', f'Distance between the student\'s CLS state at each target time of the guided card and the '
                  f'teacher\'s block output on the first {images} Fashion-MNIST test images: cosine, 1 - cosine '
                  'similarity (mean over images; 0 = aligned, 1 = orthogonal), asks whether the student\'s states '
                  'point where the teacher\'s do; gram, the mean squared difference of the two similarity matrices of '
                  'the images (`--state-norm gram`; 0 = the images relate alike), asks whether they relate the images '
                  'as the teacher\'s do, in any basis.']
    return '\n'.join(lines) + '\n'


def _guiding_teacher(guided: Path, teacher_root: Optional[Path], laid_out: Path) -> Path:
    """The weights file of the teacher that guided ``guided``, as its record names it: the path it gives, under
    ``teacher_root`` when given; else a published teacher at its revision, from the history of the checkout that
    path lies in (laid out under ``laid_out``); else that path in the working directory (a teacher never published,
    named by sha256)."""
    from ..tables import guiding_teacher
    from timm_odevit_tools.hub import WEIGHTS_FILE
    from timm_odevit_tools.hub.revisions import files_at
    teacher = guiding_teacher(guided)
    named = Path(teacher['weights'])
    if teacher_root is None and teacher.get('revision'):
        path = laid_out / teacher['repo'] / WEIGHTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        # RevisionError (a LookupError) where the checkout lacks that revision, naming the fix
        path.write_bytes(files_at(named.parent.parent, teacher['repo'], teacher['revision'])[WEIGHTS_FILE])
        return path
    path = Path(teacher_root or '.') / named
    if not path.is_file():
        raise FileNotFoundError(f'{guided.name} was guided by {named}, which is not under '
                                f'{teacher_root or "the working directory"}: run from the repository root, or lay it '
                                'out in a folder of its own and pass that as --teacher-root.')
    return path


def write_weights_trajectory(root: Path, out_dir: Path, test_samples: int = 256,
                             data_dir: Optional[str] = None, teacher_root: Optional[Path] = None) -> str:
    """The trajectory of the published students: for each guided weight under ``root`` and its scratch twin (the
    rows of ``experiments.weights table --kind guided``), the distance between each student's CLS state at the guided
    record's target times and the teacher's block outputs, on the first ``test_samples`` test images preprocessed as
    the record's command trained on. Writes ``trajectory.md`` and ``trajectory.csv`` under ``out_dir``; returns
    the Markdown.

    Read from the published files alone (each record's commands, target times and teacher), so anyone with the
    weights reruns it; checkpoints are not needed. A published teacher is loaded at the revision the record names,
    from the history of the checkout (the record's path is relative to the repository root, the working directory);
    an unpublished one from that path; from that path under ``teacher_root`` instead where given."""
    from safetensors.torch import load_file
    from ..tables import stage_commands, teacher_target_times, guided_pairs
    from timm_odevit_tools.train import recorded_args
    from timm_odevit_tools.train.command import build_task
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix='teacher_at_revision_') as laid_out:
        for arch, teacher, scratch, guided in guided_pairs(root):
            args = recorded_args(stage_commands(guided)[-1])  # the stage the teacher guided
            if args.teacher_checkpoint:
                args.teacher_checkpoint = str(_guiding_teacher(guided, teacher_root, Path(laid_out)))
            args.times = ','.join(str(t) for t in teacher_target_times(guided))
            # the published weights replace the student's parameters anyway: nothing to load or copy before them
            args.initial_checkpoint, args.no_init_from_teacher = '', True
            task = build_task(args, torch.device('cpu'))  # loads the teacher, so inside the laid-out folder's life
            task.eval()
            student = task.get_eval_model()
            images = _images_as_trained(args, student, data_dir, test_samples)
            for arm, repo in zip(ARMS, (scratch, guided)):
                student.load_state_dict(load_file(str(repo / 'model.safetensors')))
                with torch.no_grad():
                    gaps = task.state_gaps(images, WEIGHTS_TRAJECTORY_NORMS).tolist()  # one solve, both distances
                rows += [{'student': arch, 'teacher': teacher, 'arm': arm, 'weights': repo.name, 'distance': distance,
                          'times': [round(float(t), 3) for t in task.target_times], 'gaps': row}
                         for distance, row in zip(WEIGHTS_TRAJECTORY_NORMS, gaps)]
    if not rows:
        raise FileNotFoundError(f'No guided weight under {root} has a published scratch twin trained alike: '
                                'python -m experiments.weights table --kind guided lists the pairs.')
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # six decimals: the table's three, rendered from the csv, are those of the measured value
    csv_rows = [{'student': r['student'], 'teacher': r['teacher'], 'arm': r['arm'], 'weights': r['weights'],
                 'distance': r['distance'], 'images': len(images), 'time': t, 'gap': round(g, 6)}
                for r in rows for t, g in zip(r['times'], r['gaps'])]
    with open(out / 'trajectory.csv', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        w.writeheader()
        w.writerows(csv_rows)
    table = trajectory_table(csv_rows)
    (out / 'trajectory.md').write_text(table)
    return table
