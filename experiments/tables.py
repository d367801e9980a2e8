"""The tables of published weights, read from their records and their cards' model-index (data, never a card's
Markdown), and from the committed training logs: the README's weights table, the matched SSoG-minus-dense comparison,
teacher-guided against scratch, the three-way dense, fixed and steered SSoG comparison of training runs, and the
learning curves."""
import json
import math
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from timm_odevit.models.families import FAMILIES, SETTINGS, Family, family_of
from timm_odevit_tools.train import PROG, format_command, is_training_command, read_summary, recorded_args
from timm_odevit_tools.hub import CARD_FILE
from timm_odevit_tools.hub.record import RECORD_FILE, read_record, read_results, top1
from timm_odevit_tools.hub.verify import EXPORT_FIX

from .paper import PAPER_GAIN, PAPER_GUIDANCE_GAIN, PAPER_STEER_GAIN

__all__ = ['guided_pairs', 'guided_table', 'guiding_teacher', 'learning_curves', 'matched_table', 'stage_commands',
           'steered_table', 'teacher_target_times', 'training_budget', 'weight_facts', 'weights_table']

def weight_facts(repo_dir: Path) -> Dict[str, str]:
    """Params (M), GMACs, input size and the top-1 on the sample and the full test set of a published weight, as
    its card states them, from its record and its card's model-index; for an ODE weight trained on another grid
    than its architecture's default, the default's step count and full-test top-1 (``default_solver_steps``,
    ``test_default_solver``)."""
    record, results = read_record(repo_dir), read_results(repo_dir)
    c, h, w = record['input_size']
    facts = {'params': f'{record["params"] / 1e6:.3f}', 'gmacs': f'{record["gmacs"]:.4f}', 'image': f'{c}x{h}x{w}'}
    for key, data in (('sample', 'sample'), ('test', 'full')):
        value = top1(results, data, record['solver'])
        if value is None:
            raise ValueError(f'{Path(repo_dir) / CARD_FILE} has no top-1 on the {data} test set at '
                             f'{record["solver"] or "its depth"}: re-measure it with '
                             f'`python -m timm_odevit_tools.hub remeasure {repo_dir}`.')
        facts[key] = f'{value:.2f}'
    default = record.get('default_solver')
    value = top1(results, 'full', default) if default else None
    if value is not None:
        facts['default_solver_steps'], facts['test_default_solver'] = default.split(':')[1], f'{value:.2f}'
    return facts


def training_budget(repo_dir: Path) -> str:
    """Images seen in training over every stage of a weight's record, e.g. '660k (11 epochs of 60,000)' (ValueError
    when the record states no stage)."""
    stages = read_record(repo_dir)['stages']
    if not stages:
        raise ValueError(f'{Path(repo_dir) / RECORD_FILE} states no training stage: re-export it with '
                         f'`{EXPORT_FIX}`.')
    sizes = [stage['images_per_epoch'] for stage in stages]
    seen = sum(stage['images_per_epoch'] * stage['epochs'] for stage in stages)
    of = f'of {sizes[0]:,}' if len(set(sizes)) == 1 else 'in all'
    return f'{seen / 1000:,.0f}k ({sum(stage["epochs"] for stage in stages)} epochs {of})'


def weights_table(root: Path) -> str:
    """Markdown: one row per ``<arch>.<tag>`` folder under ``root``, sorted by name. The top-1 figures are at the
    solver a user gets (the one the weights were trained on); an ODE weight trained on another grid than its
    architecture's default has its top-1 at that default beside."""
    lines: List[str] = ['| weights (`pretrained=True`) | input | params (M) | GMACs | training images seen | '
                        "top-1 sample (1,000) | top-1 test (10,000) | top-1 test, architecture's default solver |",
                        '|---|---|---:|---:|---|---:|---:|---:|']
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        f = weight_facts(repo)
        lines.append(f'| `{repo.name}` | {f["image"]} | {f["params"]} | {f["gmacs"]} | {training_budget(repo)} | '
                     f'{f["sample"]}% | {f["test"]}% | '
                     + (f'{f["test_default_solver"]}% ({f["default_solver_steps"]} steps) |'
                        if 'test_default_solver' in f else '- |'))
    return '\n'.join(lines) + '\n'


def stage_commands(repo_dir: Path) -> List[str]:
    """The commands that trained a weight, one per stage in training order, as its record states them."""
    return [stage['command'] for stage in read_record(repo_dir)['stages'] if stage.get('command')]


# a fixed-kernel SSoG model's name where a command names it (a stage starting from an SSoG model of another depth)
_SSOG_NAME = re.compile(r'\b(' + '|'.join(sorted((f.name for f in FAMILIES.values() if f.is_ssog and not f.steer),
                                                   key=len, reverse=True)) + r')_(?!steer_)(?=\w)')


def _as_dense(command: str) -> str:
    """A command with every fixed-kernel SSoG model it names replaced by that model's dense twin."""
    return _SSOG_NAME.sub(lambda m: FAMILIES[m.group(1)].twin + '_', command)


# the thread count a command ran with: the machine's share, not the recipe (two runs side by side get one each)
_THREADS = re.compile(r'^OMP_NUM_THREADS=\d+ ')


def _same_recipe(a: Sequence[str], b: Sequence[str], arch_a: str, arch_b: str) -> bool:
    """Whether two weights' commands (one per stage) are the same, each weight's own model name aside (it also names
    the weights a next stage starts from), an earlier stage's SSoG model aside from its dense twin (an ODE weight
    that started from its looped twin's weights, the dense ODE one from the dense looped one), and the CPU threads
    each ran with aside."""
    def canonical(command: str, arch: str) -> str:
        return _as_dense(_THREADS.sub('', command).replace(arch, '@'))
    return bool(a) and len(a) == len(b) and all(canonical(x, arch_a) == canonical(y, arch_b) for x, y in zip(a, b))


def _published(root: Path) -> Iterator[Tuple[Path, Family]]:
    """Each weights folder under ``root`` in name order, with its model's family."""
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        yield repo, family_of(repo.name.partition('.')[0])


def _twin_trained_alike(repo: Path, family: Family) -> Optional[Path]:
    """The dense twin's folder at the size and tag of ``repo`` when it is published and the same commands (the model
    name aside, one per stage) trained it and ``repo``; None otherwise."""
    arch, _, tag = repo.name.partition('.')
    size = arch[len(family.name):]
    twin = repo.parent / f'{family.twin}{size}.{tag}'
    if twin.is_dir() and _same_recipe(stage_commands(repo), stage_commands(twin), arch, family.twin + size):
        return twin
    return None


def matched_table(root: Path) -> str:
    """Markdown: SSoG minus its dense twin, one row per SSoG weight whose twin is published under the same tag and
    was trained by the same command (the model name aside); pairs with other recipes are left out, not compared."""
    lines = ['| setting | SSoG weights | top-1 SSoG | dense twin | top-1 dense | SSoG minus dense (points) | '
             'paper gain | training images seen |', '|---|---|---:|---|---:|---:|---:|---|']
    rows = []
    for repo, family in _published(root):
        twin = _twin_trained_alike(repo, family) if family.is_ssog else None
        if twin is None:
            continue
        ssog, dense, gain = _compared_cells(repo, twin)
        setting = 'steered' if family.steer else family.depth
        lo, hi = PAPER_GAIN[setting]
        rows.append((list(PAPER_GAIN).index(setting), f'| {setting} | `{repo.name}` | {ssog} | `{twin.name}` | '
                     f'{dense} | {gain} | +{lo} to +{hi} | {training_budget(repo)} |'))
    # the settings in the papers' order (discrete, looped, ODE), as in the study's table; name order within one
    lines += [line for _, line in sorted(rows)]
    return '\n'.join(lines) + '\n'


def _scratch_command(command: str, own: Optional[str] = None) -> str:
    """A recorded training command with every distillation option at its default, in canonical form: the command
    that trains the same recipe without a teacher. A stage that continues the weight ``own`` itself (its
    ``--initial-checkpoint`` in that weight's folder) names it as ``<own>``, so that two weights continued alike,
    each from itself, have the same recipe."""
    from timm_odevit_tools.train.command import distillation_options
    args = vars(recorded_args(command))
    defaults = vars(recorded_args(f'{PROG} --model {args["model"]}'))
    args.update({k: defaults[k] for k in distillation_options()})
    if own and Path(args.get('initial_checkpoint') or '').parent.name == own:
        args['initial_checkpoint'] = '<own>'
    return format_command(args)


def _top1_cells(repo: Path) -> Tuple[float, Optional[Tuple[str, float]]]:
    """Full-test top-1 as ``pretrained=True`` solves it and, for an ODE weight trained on another grid than its
    architecture's default, (steps, top-1) at that default."""
    f = weight_facts(repo)
    default = (f['default_solver_steps'], float(f['test_default_solver'])) if 'test_default_solver' in f else None
    return float(f['test']), default


def _compared_cells(a: Path, b: Path) -> Tuple[str, str, str]:
    """Table cells: full-test top-1 of weights ``a`` and ``b`` and a minus b as ``pretrained=True`` solves them and,
    where both are ODE weights trained on another grid than one architecture default, at that default too."""
    (top1_a, default_a), (top1_b, default_b) = _top1_cells(a), _top1_cells(b)
    cells = (f'{top1_a:.2f}%', f'{top1_b:.2f}%', f'{top1_a - top1_b:+.2f}')
    if default_a and default_b and default_a[0] == default_b[0]:
        steps = default_a[0]
        cells = (f'{cells[0]} ({steps} steps: {default_a[1]:.2f}%)',
                 f'{cells[1]} ({steps} steps: {default_b[1]:.2f}%)',
                 f'{cells[2]} ({steps} steps: {default_a[1] - default_b[1]:+.2f})')
    return cells


def _training_minutes(repo: Path) -> str:
    """Minutes of training steps over every stage of a weight's record ('?' unless each stage states its own)."""
    minutes = [stage.get('minutes') for stage in read_record(repo)['stages']]
    return f'{sum(minutes):.1f}' if minutes and None not in minutes else '?'


def guided_pairs(root: Path) -> Iterator[Tuple[str, str, Path, Path]]:
    """(architecture, teacher, scratch weights, guided weights) for each published weight trained with a teacher
    whose scratch twin (the same architecture under another tag) is published and was trained by the same commands
    without the teacher's options: stage by stage where a weight was continued from earlier weights (the pair's
    earlier stages then name the same weights), the teacher guiding the last stage's trajectory."""
    # weights of the training command only (older cards name a former command): options and teacher-free recipe
    published = []
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        commands = stage_commands(repo)
        if commands and all(map(is_training_command, commands)):
            published.append((repo, recorded_args(commands[-1]), [_scratch_command(c, repo.name) for c in commands]))
    for guided, args, recipe in published:
        if not args.teacher or args.distill != 'trajectory':
            continue  # logit KD alone (--distill logit) made a teacher, not a guided trajectory
        arch = guided.name.partition('.')[0]
        for scratch, other_args, other_recipe in published:
            if scratch.name.partition('.')[0] == arch and not other_args.teacher and other_recipe == recipe:
                yield arch, args.teacher, scratch, guided


def guiding_teacher(repo_dir: Path) -> Dict[str, Any]:
    """The teacher of a weight's last guided stage (the stage that guided the trajectory; earlier stages of a
    continued weight may name other teachers, e.g. a CNN's logit KD), as its record names it: ``model``, ``weights``
    (the file the run loaded), ``repo`` and ``revision`` for a published teacher else ``sha256``, ``distill``,
    ``times``; empty for a weight no teacher guided."""
    teachers = [stage['teacher'] for stage in read_record(repo_dir)['stages'] if stage.get('teacher')]
    return teachers[-1] if teachers else {}


def teacher_target_times(repo_dir: Path) -> List[float]:
    """The student times of a guided weight's targets in its guided (last guided) stage, rounded as its card writes
    them."""
    times = guiding_teacher(repo_dir).get('times')
    if not times:
        raise ValueError(f'{Path(repo_dir) / RECORD_FILE} states no student times of its targets: '
                         '--kind guided and trajectory read guided weights only (a --teacher run); re-export this '
                         f'one from its guided run with `{EXPORT_FIX}`.')
    return list(times)


def guided_table(root: Path) -> str:
    """Markdown: teacher-guided against scratch, one row per pair of ``guided_pairs``. Top-1 on the full test set
    as ``pretrained=True`` solves it, and at the architecture's default where an ODE weight was trained on another
    grid."""
    lines = ['| student | teacher | scratch weights | top-1 scratch | guided weights | top-1 guided | '
             'guided minus scratch (points) | paper gain | training images seen | training min, scratch / guided |',
             '|---|---|---|---:|---|---:|---:|---:|---|---:|']
    for arch, teacher, scratch, guided in guided_pairs(root):
        top1_guided, top1_scratch, gain = _compared_cells(guided, scratch)
        lines.append(f'| `{arch}` | `{teacher}` | `{scratch.name}` | {top1_scratch} | '
                     f'`{guided.name}` | {top1_guided} | {gain} | > +{PAPER_GUIDANCE_GAIN:g} | '
                     f'{training_budget(guided)} | {_training_minutes(scratch)} / {_training_minutes(guided)} |')
    return '\n'.join(lines) + '\n'


def _run_command(run: Path) -> str:
    """The command line that started a training run (later lines of its ``command.txt`` are resumes)."""
    return (Path(run) / 'command.txt').read_text().splitlines()[0]


def _finished_run(logs: Path, name: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The first command line and final results of the finished training run ``logs/name`` (None if unfinished)."""
    run = Path(logs) / name
    if not (run / 'results.json').is_file() or not (run / 'command.txt').is_file():
        return None
    return _run_command(run), json.loads((run / 'results.json').read_text())


def _params_m(command: str) -> float:
    import timm
    args = recorded_args(command)
    model = timm.create_model(args.model, num_classes=args.num_classes, in_chans=args.in_chans, **args.model_kwargs)
    return sum(p.numel() for p in model.parameters()) / 1e6


def _published_cell(repo: Path) -> str:
    """A published weight's full-test top-1 beside the runs it may have come from; a weight continued by later stages
    says so, since its top-1 is no longer that of the run."""
    stages = len(stage_commands(repo))
    return f'`{repo.name}` {weight_facts(repo)["test"]}%' + (f' (after {stages} stages)' if stages > 1 else '')


def steered_table(logs: Path, root: Path) -> str:
    """Markdown: dense twin vs fixed vs steered SSoG from the training runs under ``logs``, one row per finished
    steered run whose dense twin and fixed-kernel sibling finished under the same command (model name aside).

    Runs, not cards: a steered weight is published only where it is the best of its setting, and the comparison
    must not depend on which one won. Each model is scored as it would be published (the EMA after the last epoch
    where the run kept one) on the run's validation images; the full-test top-1 of whichever is published under
    ``root`` stands beside it."""
    lines = ['| setting | validation images | dense twin | fixed SSoG | steered SSoG | steered minus fixed (points) | '
             'steered minus dense (points) | standard error of one top-1 (points) | '
             'published, full test (10,000) |', '|---|---:|---|---|---|---:|---:|---:|---|']
    for run in sorted(p for p in Path(logs).iterdir() if p.is_dir()):
        arch, _, tag = run.name.partition('.')
        try:
            family = family_of(arch)
        except ValueError:  # another kind of run (a study, a guidance sweep)
            continue
        if not family.steer:
            continue
        size = arch[len(family.name):]
        names = [f'{family.twin}{size}.{tag}', f'{SETTINGS[family.depth].ssog}{size}.{tag}', run.name]
        runs = [_finished_run(logs, n) for n in names]
        if any(r is None for r in runs) or not all(
                _same_recipe([runs[2][0]], [r[0]], arch, n.partition('.')[0]) for r, n in zip(runs[:2], names[:2])):
            continue
        top1 = [r[1]['ema_top1'] if r[1].get('ema_top1') is not None else r[1]['top1'] for r in runs]
        cells = [f'`{n}` {t:.2f}% ({_params_m(r[0]):.3f}M)' for n, t, r in zip(names, top1, runs)]
        n_val = recorded_args(runs[2][0]).val_samples
        se = 100 * math.sqrt(top1[2] / 100 * (1 - top1[2] / 100) / n_val) if n_val else float('nan')
        published = ', '.join(_published_cell(Path(root) / n) for n in names if (Path(root) / n).is_dir()) or 'none'
        lo, hi = PAPER_GAIN['steered']
        lines.append(f'| {family.depth} | {n_val or "all"} | {" | ".join(cells)} | {top1[2] - top1[1]:+.2f} (paper '
                     f'+{PAPER_STEER_GAIN}) | {top1[2] - top1[0]:+.2f} (paper +{lo} to +{hi}) | {se:.2f} | '
                     f'{published} |')
    return '\n'.join(lines) + '\n'


def learning_curves(logs: Path) -> str:
    """Markdown: validation top-1 after each epoch of every run of the training command under ``logs`` (its
    ``summary.csv``), with the EMA weights' top-1 after the last epoch where the run kept an EMA. A run that has
    not finished (no ``results.json``) says how many of its epochs it has trained."""
    lines = ['| run | validation images | top-1 after each epoch | EMA after the last |', '|---|---:|---|---:|']
    for run in sorted(p for p in Path(logs).iterdir() if (p / 'summary.csv').is_file()):
        rows = read_summary(str(run / 'summary.csv'))
        if not rows:
            continue
        args = recorded_args(_run_command(run))
        val = args.val_samples
        ema = rows[-1].get('eval_ema_top1')
        curve = ', '.join(f'{r["eval_top1"]:.1f}' for r in rows)
        if not (run / 'results.json').is_file():
            curve += f' (unfinished: {len(rows)} of {args.epochs} epochs)'
        lines.append(f'| `{run.name}` | {val or "all"} | {curve} | {"-" if ema is None else f"{ema:.1f}"} |')
    return '\n'.join(lines) + '\n'
