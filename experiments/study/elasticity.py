"""Step-count elasticity: trained ODE models solved with other methods and step counts (the same interval), top-1
against the number of field evaluations (NFE) per image; elasticity.csv, elasticity.png and elasticity.md. The
models are the study's ODE runs (``write_elasticity``) or the published ODE weights (``write_weights_elasticity``)."""
import csv
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from timm_odevit.layers import OdeSolverError
from timm_odevit_tools.evaluate import evaluate, parse_solver, solver_kwargs
from timm_odevit_tools.hub import CONFIG_FILE, WEIGHTS_FILE
from timm_odevit_tools.hub.verify import EXPORT_FIX
from .runs import STUDY_PAIRS

__all__ = ['ELASTICITY_SOLVERS', 'WEIGHTS_ELASTICITY_SOLVERS', 'elasticity_table', 'read_rows', 'write_elasticity',
           'write_weights_elasticity']

# coarser and finer than the registered 12 Euler steps, ODE-ViT's 23-step training grid and its 24 points, and RK4
ELASTICITY_SOLVERS = ('euler:3', 'euler:6', 'euler:12', 'euler:23', 'euler:24', 'rk4:3', 'rk4:6')
# the published weights: each explicit method at a quarter, half, once and twice a 23-step (or 12-step) grid's NFE,
# and dopri5 (rtol 1e-3, atol 1e-4) with the NFE it takes
WEIGHTS_ELASTICITY_SOLVERS = ('euler:3', 'euler:6', 'euler:12', 'euler:23', 'euler:24', 'euler:46', 'midpoint:3',
                              'midpoint:6', 'midpoint:12', 'rk4:2', 'rk4:3', 'rk4:6', 'dopri5')
IMAGES_LINE = 'Top-1 (%) on the first {} Fashion-MNIST test images.'
# elasticity.csv's columns: the table and the --only rows are read from it
ROW_FIELDS = ['model', 'seed', 'method', 'steps', 'nfe', 'images', 'top1']


def write_elasticity(root: Path, solvers: Sequence[str], test_samples: int = 2000) -> str:
    """Evaluate every finished ODE run of the study under each ``solvers`` entry; returns a Markdown table."""
    from timm_odevit.models.pretrained import FMNIST_CFG
    from timm_odevit_tools.train import model_from_checkpoint
    root = Path(root)

    def models() -> Iterable[Tuple[str, str, nn.Module]]:
        for arch in (STUDY_PAIRS['ode'].dense, STUDY_PAIRS['ode'].ssog):
            for run_path in sorted((root / 'runs').glob(f'{arch}-seed*')):
                if (run_path / 'results.json').is_file():
                    yield (arch, run_path.name.rsplit('seed', 1)[1],
                           model_from_checkpoint(str(run_path / 'last.pth.tar'), pretrained_cfg=FMNIST_CFG))
    title = f'trained with {", ".join(STUDY_PAIRS["ode"].model_kwargs) or "the default grid"}'
    return _write(_measure(models(), solvers, test_samples, None), root, title,
                  f'No finished ODE runs under {root / "runs"}: run '
                  f'`python -m experiments.study run --out-dir {root}`.')


def write_weights_elasticity(root: Path, out_dir: Path, solvers: Sequence[str], test_samples: int = 2000,
                             data_dir: Optional[str] = None, only: Optional[Sequence[str]] = None,
                             looped_as_ode: bool = False, jobs: int = 1) -> str:
    """Evaluate every published ODE weight under ``root`` (``<arch>.<tag>`` folders, loaded as timm loads them, with
    ``local-dir:``) under each ``solvers`` entry, on the first ``test_samples`` test images; writes under
    ``out_dir`` and returns a Markdown table.

    ``only``: measure just these folders (a weight that was re-exported) and keep every other weight's rows from
    ``out_dir``'s last table, which must hold them at the same solvers and number of images (ValueError otherwise:
    rerun without ``only``).

    ``looped_as_ode``: also solve each published looped weight as its ODE twin (the same parameters; at the
    registered grid, h = 1, the same function), a row named ``<looped weights> as <ODE architecture>``.

    ``jobs``: measure that many weights at once, each in a process of its own with an equal share of torch's threads;
    the same rows in the same order as one process gives."""
    if jobs < 1:
        raise ValueError(f'jobs={jobs}: give the number of weights to measure at once, 1 or more')
    from timm_odevit.models.families import family_of
    folders = [p for p in sorted(Path(root).iterdir()) if p.is_dir()]
    # (row name, folder, the ODE architecture a looped weight is solved as; None: the folder's own)
    entries = [(p.name, p, None) for p in folders if family_of(p.name.partition('.')[0]).depth == 'ode']
    if looped_as_ode:
        twins = [(p, _ode_twin(p.name.partition('.')[0])) for p in folders]
        entries += [(f'{p.name} as {ode}', p, ode) for p, ode in twins if ode]
    names = [name for name, _, _ in entries]
    kept: List[Dict[str, object]] = []
    if only:
        unknown = sorted(set(only) - {p.name for _, p, _ in entries})
        if unknown:
            raise ValueError(f'--only {" ".join(unknown)}: no such ODE weight under {root} (there are: '
                             f'{", ".join(names) or "none"})')
        kept = _kept_rows(Path(out_dir), [n for n, p, _ in entries if p.name not in only], names, solvers,
                          test_samples)
        entries = [e for e in entries if e[1].name in only]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if jobs > 1 and len(entries) > 1:
        rows = _measure_in_processes(entries, solvers, test_samples, data_dir, jobs)
    else:
        rows = _measure((_load_weight(*e) for e in entries), solvers, test_samples, data_dir)
    return _write(rows, Path(out_dir), 'published weights',
                  f'No ODE weights under {root}: export one with `{EXPORT_FIX} --root {root}`.', kept, names)


def _load_weight(name: str, folder: Path, ode: Optional[str]) -> Tuple[str, str, nn.Module]:
    """(row name, seed, model) for one published weight, loaded as timm loads it; ``ode``: the ODE architecture a
    looped weight is solved as."""
    import timm
    import timm_odevit  # noqa: F401  (registers the architectures config.json names)
    if ode is None:
        return name, '', timm.create_model(f'local-dir:{folder.resolve()}', pretrained=True)
    # as local-dir: would build the looped model, with the ODE architecture in its place
    config = json.loads((folder / CONFIG_FILE).read_text())
    weights = str(folder.resolve() / WEIGHTS_FILE)
    return name, '', timm.create_model(ode, pretrained=True, **config.get('model_args', {}),
                                       pretrained_cfg=dict(config['pretrained_cfg'], file=weights))


def _measure_weight(entry: Tuple[str, Path, Optional[str]], solvers: Sequence[str], test_samples: int,
                    data_dir: Optional[str], threads: int) -> List[Dict[str, object]]:
    """One weight's rows, in a worker process of ``_measure_in_processes``."""
    import torch
    torch.set_num_threads(threads)
    return _measure([_load_weight(*entry)], solvers, test_samples, data_dir)


def _measure_in_processes(entries: Sequence[Tuple[str, Path, Optional[str]]], solvers: Sequence[str],
                          test_samples: int, data_dir: Optional[str], jobs: int) -> List[Dict[str, object]]:
    """``_measure`` of each entry in a pool of ``jobs`` processes, rows in the entries' order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    import torch
    threads = max(1, torch.get_num_threads() // jobs)
    # spawn, not fork: a child forked after torch's OpenMP pool started can hang at its first parallel op
    spawn = multiprocessing.get_context('spawn')
    with ProcessPoolExecutor(max_workers=min(jobs, len(entries)), mp_context=spawn) as pool:
        parts = [pool.submit(_measure_weight, e, solvers, test_samples, data_dir, threads) for e in entries]
        return [row for part in parts for row in part.result()]


def _ode_twin(arch: str) -> Optional[str]:
    """The ODE architecture with the parameters of a looped one (``looped_ssog_tiny_patch4_32`` ->
    ``ssog_ode_tiny_patch4_32``); None for an architecture that is not looped."""
    from timm_odevit.models.families import SETTINGS, family_of
    family = family_of(arch)
    if family.depth != 'looped':
        return None
    ode = SETTINGS['ode'].ssog if family.name == SETTINGS['looped'].ssog else SETTINGS['ode'].dense
    return ode + arch[len(family.name):]


def _kept_rows(out: Path, keep: Sequence[str], names: Sequence[str], solvers: Sequence[str],
               test_samples: int) -> List[Dict[str, object]]:
    """The rows of ``keep`` from ``out``'s elasticity.csv, checked to be at ``solvers`` on ``test_samples`` images
    (each row states its number); refused where the new table, rows ``names``, would drop one of its rows."""
    table = out / 'elasticity.csv'
    last = read_rows(table) if table.is_file() else []
    lost = sorted({r['model'] for r in last} - set(names))
    if lost:
        raise ValueError(f'{table} holds rows that this table would lose ({", ".join(lost)}): rerun with the options '
                         'that made them (--looped-as-ode for the looped weights), or without --only')
    if not keep:
        return []
    rerun = 'rerun python -m experiments.weights elasticity without --only'
    if not last:
        raise ValueError(f'{out} holds no earlier elasticity.csv to keep the other weights\' rows from: {rerun}')
    rows = [r for r in last if r['model'] in keep]
    other = sorted({r['images'] for r in rows} - {test_samples})
    if other:
        raise ValueError(f'{table} was measured on {" and ".join(map(str, other))} test images, not {test_samples}: '
                         f'{rerun}')
    want = [parse_solver(s) for s in solvers]
    for name in keep:
        have = [(r['method'], r['steps']) for r in rows if r['model'] == name]
        if have != want:
            raise ValueError(f'{table} has {name} at {have or "no solver"}, not at {want}: {rerun}')
    return rows


def _measure(models: Iterable[Tuple[str, str, nn.Module]], solvers: Sequence[str], test_samples: int,
             data_dir: Optional[str]) -> List[Dict[str, object]]:
    """The rows of elasticity.csv: each of ``models`` at each solver on the first ``test_samples`` test images."""
    from timm_odevit_tools import data as fm
    parsed = [parse_solver(s) for s in solvers]
    rows: List[Dict[str, object]] = []
    images: Dict[Tuple[int, ...], Tuple] = {}  # test images per input size: weights differ in size
    for label, seed, model in models:
        size = tuple(model.pretrained_cfg['input_size'])
        if size not in images:
            images[size] = fm.load_tensors(data_dir, 'test', model=model, limit=test_samples)
        for method, steps in parsed:
            model.trunk.set_solver(**solver_kwargs(method, steps))
            try:
                r = evaluate(model, images[size])
            except OdeSolverError:  # an adaptive solve past max_nfe: the field is too stiff for its tolerances
                r = {'nfe': model.trunk.max_nfe, 'top1': math.nan}
            rows.append({'model': label, 'seed': seed, 'method': method, 'steps': steps,
                         'nfe': round(r['nfe']), 'images': len(images[size][1]), 'top1': round(r['top1'], 2)})
    return rows


def _write(rows: List[Dict[str, object]], out: Path, title: str, none_found: str,
           kept: Sequence[Dict[str, object]] = (), order: Sequence[str] = ()) -> str:
    """Add the ``kept`` rows to the measured ``rows`` (models in ``order``), write the csv, figure and Markdown
    table under ``out``."""
    if not rows:
        raise FileNotFoundError(none_found)
    if kept:
        position = {name: i for i, name in enumerate(order)}
        rows = sorted([*kept, *rows], key=lambda r: position[r['model']])  # stable: each model's solver order kept
    with open(out / 'elasticity.csv', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        w.writerows(rows)
    _plot(rows, out / 'elasticity.png', rows[0]['images'], title)
    table = elasticity_table(rows)
    (out / 'elasticity.md').write_text(table)
    return table


def read_rows(path: Path) -> List[Dict[str, Any]]:
    """The rows of an elasticity.csv, numbers as numbers."""
    with open(path, newline='') as f:
        return [{**r, 'steps': int(r['steps']), 'nfe': int(r['nfe']), 'images': int(r['images']),
                 'top1': float(r['top1'])} for r in csv.DictReader(f)]


def elasticity_table(rows: Sequence[Dict[str, Any]]) -> str:
    """elasticity.md from the rows of elasticity.csv (``read_rows``): one column per solver, in the order measured,
    with its NFE; one row per model and seed."""
    solvers = list(dict.fromkeys((r['method'], r['steps']) for r in rows))
    head = '| model | seed | ' + ' | '.join(f'{m} {s}' if s else m for m, s in solvers) + ' |'
    # an adaptive solver's NFE differs by model: its row gives the range
    nfes = [sorted({r['nfe'] for r in rows if (r['method'], r['steps']) == ms}) for ms in solvers]
    lines = [head, '|---|---:|' + '---:|' * len(solvers), '| NFE | | ' + ' | '.join(
        str(n[0]) if len(n) == 1 else f'{n[0]}-{n[-1]}' for n in nfes) + ' |']
    for model, seed in dict.fromkeys((r['model'], r['seed']) for r in rows):
        vals = {(r['method'], r['steps']): r['top1'] for r in rows if (r['model'], r['seed']) == (model, seed)}
        lines.append(f'| `{model}` | {seed} | ' + ' | '.join(
            'over max_nfe' if math.isnan(vals[ms]) else f'{vals[ms]:.2f}' for ms in solvers) + ' |')
    images = sorted({r['images'] for r in rows})
    return '\n'.join(lines) + '\n\n' + IMAGES_LINE.format(' / '.join(map(str, images))) + '\n'


def _plot(rows: List[Dict[str, object]], path: Path, n: int, title: str) -> None:
    from timm_odevit_tools.plots import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {'euler': 'o-', 'midpoint': '^-.', 'rk4': 's--', 'dopri5': 'D'}
    for model, seed in dict.fromkeys((r['model'], r['seed']) for r in rows):
        for method in dict.fromkeys(r['method'] for r in rows):
            pts = sorted((r['nfe'], r['top1']) for r in rows
                         if (r['model'], r['seed'], r['method']) == (model, seed, method))
            if pts:
                name = f'{model.split("_")[0]} s{seed}' if seed != '' else model
                ax.plot(*zip(*pts), styles.get(method, 'x:'), color='tab:red' if 'ssog' in model else 'tab:blue',
                        alpha=.55 if seed not in ('', '0') else 1., label=f'{name} {method}')
    ax.set_xscale('log', base=2)
    ax.set_xlabel('field evaluations per image (NFE)')
    ax.set_ylabel(f'top-1 (%), {n} test images')
    ax.set_title(f'Step-count elasticity ({title})')
    ax.grid(alpha=.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
