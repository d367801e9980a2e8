"""The study's report: per-run final metrics (results.csv), the table of mean and spread over seeds against the
paper's claim (results.md), and validation top-1 per epoch (curves.png)."""
import csv
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Sequence

from timm_odevit_tools.train import read_summary
from ..paper import PAPER_GAIN
from .runs import STUDY_PAIRS

__all__ = ['collect', 'write_report']



def collect(root: Path) -> List[Dict[str, Any]]:
    """One row per finished run: setting, arch, seed, params, final and best val top-1, wall seconds, curve."""
    import timm
    import timm_odevit  # noqa: F401  (registers the archs)
    rows = []
    params: Dict[str, float] = {}
    for setting, (dense, ssog, _) in STUDY_PAIRS.items():
        for arch in (dense, ssog):
            for run_path in sorted((Path(root) / 'runs').glob(f'{arch}-seed*')):
                res = run_path / 'results.json'
                if not res.is_file():
                    continue
                if arch not in params:
                    params[arch] = sum(p.numel() for p in timm.create_model(arch, num_classes=10, in_chans=1)
                                       .parameters()) / 1e6
                curve = read_summary(str(run_path / 'summary.csv'))
                wall = run_path / 'wall_seconds.txt'
                rows.append({
                    'setting': setting, 'mixer': 'ssog' if arch == ssog else 'dense', 'arch': arch,
                    'seed': int(run_path.name.rsplit('seed', 1)[1]), 'params_m': round(params[arch], 3),
                    'val_top1': round(json.loads(res.read_text())['top1'], 2),
                    'best_val_top1': round(max(r['eval_top1'] for r in curve), 2),
                    'wall_s': round(sum(float(v) for v in wall.read_text().split()), 1) if wall.is_file() else '',
                    'curve': [(int(r['epoch']), r['eval_top1']) for r in curve],
                })
    return rows


def mean_sd(values: Sequence[float]) -> str:
    """'mean ± sample SD' of a few runs; one run has no SD to show ('81.00 (1 run)'), none gives 'n/a'."""
    if not values:
        return 'n/a'
    if len(values) == 1:
        return f'{values[0]:.2f} (1 run)'
    return f'{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}'


def write_report(root: Path) -> str:
    """Write results.csv, results.md and curves.png under ``root``; returns the Markdown table."""
    root = Path(root)
    rows = collect(root)
    if not rows:
        raise FileNotFoundError(f'No finished runs under {root / "runs"}: run '
                                f'`python -m experiments.study run --out-dir {root}` first.')
    with open(root / 'results.csv', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != 'curve'])
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if k != 'curve'})
    recipe = json.loads((root / 'study.json').read_text())['recipe'] if (root / 'study.json').is_file() else {}
    lines = [
        '| setting | dense twin | params (M) | top-1 dense | SSoG | params (M) | top-1 SSoG | gain (points) | '
        'paper gain | agrees |',
        '|---|---|---:|---:|---|---:|---:|---:|---:|---|',
    ]
    for setting, (dense, ssog, _) in STUDY_PAIRS.items():
        d = {r['seed']: r for r in rows if r['arch'] == dense}
        s = {r['seed']: r for r in rows if r['arch'] == ssog}
        if not d or not s:
            continue
        paired = [s[k]['val_top1'] - d[k]['val_top1'] for k in sorted(set(d) & set(s))]
        lo, hi = PAPER_GAIN[setting]
        gain = statistics.mean(paired) if paired else float('nan')
        agrees = 'yes' if lo <= gain <= hi else 'larger' if gain > hi else 'same sign, smaller' if gain > 0 else 'no'
        lines.append(
            f'| {setting} | `{dense}` | {next(iter(d.values()))["params_m"]:.3f} | '
            f'{mean_sd([r["val_top1"] for r in d.values()])} | `{ssog}` | {next(iter(s.values()))["params_m"]:.3f} | '
            f'{mean_sd([r["val_top1"] for r in s.values()])} | {mean_sd(paired)} | +{lo} to +{hi} | {agrees} |')
    n_seeds = len({r['seed'] for r in rows})
    note = (f'\nFinal-epoch top-1 on {recipe.get("val_samples", "?")} Fashion-MNIST test images, mean ± sample SD '
            f'over {n_seeds} seed(s); gain = SSoG minus dense, paired by seed. Recipe: {recipe}. '
            f'Wall time of all runs: {sum(r["wall_s"] or 0 for r in rows) / 60:.0f} min (1 thread each).\n')
    table = '\n'.join(lines) + '\n' + note
    (root / 'results.md').write_text(table)
    _plot(rows, root / 'curves.png')
    return table


def _plot(rows: List[Dict[str, Any]], path: Path) -> None:
    from timm_odevit_tools.plots import pyplot
    plt = pyplot()
    fig, axes = plt.subplots(1, len(STUDY_PAIRS), figsize=(4.2 * len(STUDY_PAIRS), 3.6), sharey=True)
    for ax, setting in zip(axes, STUDY_PAIRS):
        for r in (r for r in rows if r['setting'] == setting):
            ep, top1 = zip(*r['curve'])
            ax.plot([e + 1 for e in ep], top1, marker='o', color='tab:red' if r['mixer'] == 'ssog' else 'tab:blue',
                    linestyle='-' if r['seed'] == 0 else '--', label=f'{r["mixer"]} seed {r["seed"]}')
        ax.set_title(setting)
        ax.set_xlabel('epoch')
        ax.grid(alpha=.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0].set_ylabel('validation top-1 (%)')
    fig.suptitle('Fashion-MNIST, tiny, 32 px: SSoG (red) vs dense twin (blue)')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
