"""Step-count elasticity: the study's trained ODE models solved with other methods and step counts (the same
interval), top-1 against the number of field evaluations (NFE) per image; elasticity.csv and elasticity.png."""
import csv
from pathlib import Path
from typing import Dict, List, Sequence

from ..evaluate import evaluate, parse_solver
from .runs import SETTINGS

__all__ = ['write_elasticity']


def write_elasticity(root: Path, solvers: Sequence[str], test_samples: int = 2000) -> str:
    """Evaluate every finished ODE run of the study under each ``solvers`` entry; returns a Markdown table."""
    from .. import data as fm
    from ..models.pretrained import FMNIST_CFG
    from ..train import model_from_checkpoint
    root = Path(root)
    parsed = [parse_solver(s) for s in solvers]
    rows: List[Dict[str, object]] = []
    x = y = None
    for arch in SETTINGS['ode'][:2]:
        for run_path in sorted((root / 'runs').glob(f'{arch}-seed*')):
            if not (run_path / 'results.json').is_file():
                continue
            model = model_from_checkpoint(str(run_path / 'last.pth.tar'), pretrained_cfg=FMNIST_CFG)
            if x is None:
                x, y = fm.load_tensors(None, 'test', model=model, limit=test_samples)
            for method, steps in parsed:
                model.trunk.set_solver(method=method, steps=steps)
                r = evaluate(model, (x, y))
                rows.append({'arch': arch, 'seed': int(run_path.name.rsplit('seed', 1)[1]), 'method': method,
                             'steps': steps, 'nfe': round(r['nfe']), 'top1': round(r['top1'], 2)})
    if not rows:
        raise FileNotFoundError(f'No finished ODE runs under {root / "runs"}: run `python -m timm_odevit.study run`.')
    with open(root / 'elasticity.csv', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, root / 'elasticity.png', len(x))
    head = '| model | seed | ' + ' | '.join(f'{m} {s}' for m, s in parsed) + ' |'
    lines = [head, '|---|---:|' + '---:|' * len(parsed), '| NFE | | ' + ' | '.join(
        str(next(r['nfe'] for r in rows if (r['method'], r['steps']) == ms)) for ms in parsed) + ' |']
    for arch, seed in dict.fromkeys((r['arch'], r['seed']) for r in rows):
        vals = {(r['method'], r['steps']): r['top1'] for r in rows if (r['arch'], r['seed']) == (arch, seed)}
        lines.append(f'| `{arch}` | {seed} | ' + ' | '.join(f'{vals[ms]:.2f}' for ms in parsed) + ' |')
    table = '\n'.join(lines) + f'\n\nTop-1 (%) on the first {len(x)} Fashion-MNIST test images.\n'
    (root / 'elasticity.md').write_text(table)
    return table


def _plot(rows: List[Dict[str, object]], path: Path, n: int) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {'euler': 'o-', 'rk4': 's--'}
    for arch, seed in dict.fromkeys((r['arch'], r['seed']) for r in rows):
        for method in dict.fromkeys(r['method'] for r in rows):
            pts = sorted((r['nfe'], r['top1']) for r in rows
                         if (r['arch'], r['seed'], r['method']) == (arch, seed, method))
            if pts:
                ax.plot(*zip(*pts), styles.get(method, 'x:'), color='tab:red' if 'ssog' in arch else 'tab:blue',
                        alpha=1. if seed == 0 else .55, label=f'{arch.split("_")[0]} s{seed} {method}')
    ax.set_xscale('log', base=2)
    ax.set_xlabel('field evaluations per image (NFE)')
    ax.set_ylabel(f'top-1 (%), {n} test images')
    ax.set_title(f'Step-count elasticity (trained with {", ".join(SETTINGS["ode"][2]) or "the default grid"})')
    ax.grid(alpha=.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
