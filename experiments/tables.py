"""The tables of published weights, read from the model cards (one source of truth: the cards) and the committed
training logs: the README's weights table, the matched SSoG-minus-dense comparison, teacher-guided against scratch,
the three-way dense, fixed and steered SSoG comparison of training runs, and the learning curves."""
import json
import math
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from timm_odevit.models.families import FAMILIES, SETTINGS, Family, family_of
from timm_odevit_tools.train import PROG, format_command, is_training_command, read_summary, recorded_args
from timm_odevit_tools.hub import CARD_FILE
from timm_odevit_tools.hub.verify import EXPORT_FIX

from .paper import PAPER_GAIN, PAPER_GUIDANCE_GAIN, PAPER_STEER_GAIN

__all__ = ['card_commands', 'card_facts', 'card_teacher_sha256', 'guided_table', 'learning_curves',
           'matched_table', 'steered_table', 'training_budget', 'weights_table']

_FIELDS = {
    'params': r'\*\*Params \(M\):\*\* ([\d.]+)',
    'gmacs': r'\*\*GMACs:\*\* ([\d.]+)',
    'image': r'\*\*Image size:\*\* (\d+) x \d+, (\d) channel',
    'sample': r'sample \(1,000 test images, bundled\): top-1 ([\d.]+)%',
    'test': r'Fashion-MNIST test set \(10,000 images\): top-1 ([\d.]+)%',
}
# an ODE weight trained on another grid than its architecture's default: the card's full-test top-1 at that default
_DEFAULT_SOLVER = (r"test set \(10,000 images\), at the architecture's default solver \(\w+, (\d+) steps\): "
                   r'top-1 ([\d.]+)%')


def card_facts(repo_dir: Path) -> Dict[str, str]:
    """Params, GMACs, input size and the two top-1 figures a model card states (ValueError naming what is missing),
    and for an ODE weight trained on another grid than its architecture's default the default's step count and
    full-test top-1 (``default_solver_steps``, ``test_default_solver``)."""
    card = (Path(repo_dir) / CARD_FILE).read_text(encoding='utf-8')
    facts = {}
    for key, pattern in _FIELDS.items():
        m = re.search(pattern, card)
        if not m:
            raise ValueError(f'{repo_dir / CARD_FILE} lacks its {key}: re-export it with `{EXPORT_FIX}` '
                             f'(a study run: python -m experiments.study export), or re-render its card from its '
                             f'config: python -m timm_odevit_tools.hub remeasure {repo_dir}.')
        facts[key] = m.group(1) if key != 'image' else f'{m.group(2)}x{m.group(1)}x{m.group(1)}'
    m = re.search(_DEFAULT_SOLVER, card)
    if m:
        facts['default_solver_steps'], facts['test_default_solver'] = m.groups()
    return facts


def training_budget(repo_dir: Path) -> str:
    """Images seen in training, from the card's recipe: each stage's training images times its epochs, e.g.
    '660k (11 epochs of 60,000)' (ValueError when the card states no recipe)."""
    card = (Path(repo_dir) / CARD_FILE).read_text(encoding='utf-8')
    sizes = [int(n) for n in re.findall(r'data: (\d+) (?:Fashion-MNIST )?training images', card)]
    epochs = [int(n) for n in re.findall(r'schedule: (\d+) epochs', card)]
    if not sizes or len(sizes) != len(epochs):
        raise ValueError(f'{repo_dir / CARD_FILE} states no training data and schedule per stage: re-export it with '
                         f'`{EXPORT_FIX}`.')
    seen = sum(n * e for n, e in zip(sizes, epochs))
    of = f'of {sizes[0]:,}' if len(set(sizes)) == 1 else 'in all'
    return f'{seen / 1000:,.0f}k ({sum(epochs)} epochs {of})'


def weights_table(root: Path) -> str:
    """Markdown: one row per ``<arch>.<tag>`` folder under ``root``, sorted by name. The top-1 figures are at the
    solver a user gets (the one the weights were trained on); an ODE weight trained on another grid than its
    architecture's default has its top-1 at that default beside."""
    lines: List[str] = ['| weights (`pretrained=True`) | input | params (M) | GMACs | training images seen | '
                        "top-1 sample (1,000) | top-1 test (10,000) | top-1 test, architecture's default solver |",
                        '|---|---|---:|---:|---|---:|---:|---:|']
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        f = card_facts(repo)
        lines.append(f'| `{repo.name}` | {f["image"]} | {f["params"]} | {f["gmacs"]} | {training_budget(repo)} | '
                     f'{f["sample"]}% | {f["test"]}% | '
                     + (f'{f["test_default_solver"]}% ({f["default_solver_steps"]} steps) |'
                        if 'test_default_solver' in f else '- |'))
    return '\n'.join(lines) + '\n'


def card_commands(repo_dir: Path) -> List[str]:
    """The commands that trained a weight, one per stage in training order, as its card states them."""
    return re.findall(r'command: `([^`]+)`', (Path(repo_dir) / CARD_FILE).read_text(encoding='utf-8'))


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
    if twin.is_dir() and _same_recipe(card_commands(repo), card_commands(twin), arch, family.twin + size):
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


def _scratch_command(command: str) -> str:
    """A card's training command with every distillation option at its default, in canonical form: the command
    that trains the same recipe without a teacher."""
    from timm_odevit_tools.train.command import distillation_options
    args = vars(recorded_args(command))
    defaults = vars(recorded_args(f'{PROG} --model {args["model"]}'))
    args.update({k: defaults[k] for k in distillation_options()})
    return format_command(args)


def _top1_cells(repo: Path) -> Tuple[float, Optional[Tuple[str, float]]]:
    """Full-test top-1 as ``pretrained=True`` solves it and, for an ODE weight trained on another grid than its
    architecture's default, (steps, top-1) at that default."""
    f = card_facts(repo)
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
    """Minutes of training steps over every stage of a card's recipe ('?' unless each stage states its own)."""
    card = (Path(repo) / CARD_FILE).read_text(encoding='utf-8')
    minutes = [float(m) for m in re.findall(r'([\d.]+) min of training steps', card)]
    stages = len(re.findall(r'schedule: \d+ epochs', card))
    return f'{sum(minutes):.1f}' if minutes and len(minutes) == stages else '?'


def guided_pairs(root: Path) -> Iterator[Tuple[str, str, Path, Path]]:
    """(architecture, teacher, scratch weights, guided weights) for each published weight trained with a teacher
    whose scratch twin (the same architecture under another tag) is published and was trained by the same commands
    without the teacher's options: stage by stage where a weight was continued from earlier weights (the pair's
    earlier stages then name the same weights), the teacher guiding the last stage's trajectory."""
    # weights of the training command only (older cards name a former command): options and teacher-free recipe
    published = []
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        commands = card_commands(repo)
        if commands and all(map(is_training_command, commands)):
            published.append((repo, recorded_args(commands[-1]), [_scratch_command(c) for c in commands]))
    for guided, args, recipe in published:
        if not args.teacher or args.distill != 'trajectory':
            continue  # logit KD alone (--distill logit) made a teacher, not a guided trajectory
        arch = guided.name.partition('.')[0]
        for scratch, other_args, other_recipe in published:
            if scratch.name.partition('.')[0] == arch and not other_args.teacher and other_recipe == recipe:
                yield arch, args.teacher, scratch, guided


def _guiding_stage_line(repo_dir: Path) -> Optional[str]:
    """The card's teacher guidance line of its last guided stage: the stage that guided the trajectory (earlier
    stages of a continued weight may name other teachers, e.g. a CNN's logit KD)."""
    card = (Path(repo_dir) / CARD_FILE).read_text(encoding='utf-8')
    lines = re.findall(r'^\s*- (?:stage \d+ of \d+, )?teacher guidance: (.*)$', card, flags=re.M)
    return lines[-1] if lines else None


def card_target_times(repo_dir: Path) -> List[float]:
    """The student times of a guided weight's targets, as its card states them for the guided (last guided) stage,
    rounded as the card writes them."""
    m = re.search(r'at student times ([\d., ]+) \(rule', _guiding_stage_line(repo_dir) or '')
    if not m:
        raise ValueError(f'{repo_dir / CARD_FILE} states no student times of its targets: '
                         '--kind guided and trajectory read guided weights only (a --teacher run); re-export this '
                         f'one from its guided run with `{EXPORT_FIX}`.')
    return [float(t) for t in m.group(1).split(',')]


def card_teacher_sha256(repo_dir: Path) -> Optional[str]:
    """The sha256 of the teacher weights that guided a weight's trajectory (its last guided stage), as its card states
    it (None where that stage names no hash: cards exported before runs recorded one)."""
    m = re.search(r'\(weights `[^`]+`, sha256 ([0-9a-f]{64})\)', _guiding_stage_line(repo_dir) or '')
    return m.group(1) if m else None


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
    stages = len(card_commands(repo))
    return f'`{repo.name}` {card_facts(repo)["test"]}%' + (f' (after {stages} stages)' if stages > 1 else '')


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
