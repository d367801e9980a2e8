"""The zoo at a glance, as tables generated from the one family table (``models/families.py``): the family grid,
every family's params, GMACs and NFE, the parameter reductions against the dense twins and the ODE-ViT paper
configs' trainable-parameter counts. ``python -m timm_odevit`` prints them; the README and docs/models.md hold them
(tests/test_docs.py keeps those copies equal to these generators).

Speed is left to the benchmark (``python -m timm_odevit_tools.benchmark``), which times interleaved repeats and reports
their spread: a one-shot ratio on a shared machine is noise.
"""
import argparse
from typing import Dict, List, Optional

import timm
import torch

from timm_odevit import models  # noqa: F401  (registers the models)
from .benchmark.runner import count_gmacs
from timm_odevit.models.families import FAMILIES, SIZES, model_name

__all__ = ['FAMILIES', 'PAPER_CONFIGS', 'count_params', 'param_reduction', 'paper_trainable_params', 'zoo_table',
           'reduction_table', 'paper_table', 'grid_table', 'TABLES']

# ODE-ViT paper configurations -> the trainable-parameter count the paper reports
PAPER_CONFIGS: Dict[str, float] = {
    'odevit_w768_mlp1_36pt': 3.8e6,
    'odevit_w768_mlp4_24pt': 7.0e6,
}
PAPER_NUM_CLASSES = 100  # the paper's counts are for its CIFAR-100 students


def count_params(name: str, **kwargs) -> int:
    model = timm.create_model(name, device='meta', **kwargs)
    return sum(p.numel() for p in model.parameters())


def param_reduction(ssog_name: str, dense_name: str) -> float:
    """Percent fewer parameters in the SSoG model than in its dense twin."""
    ssog, dense = count_params(ssog_name), count_params(dense_name)
    return 100. * (dense - ssog) / dense


def paper_trainable_params(name: str) -> int:
    """Trainable parameters as the ODE-ViT paper counts them for its teacher-guided students: the patch embedding,
    CLS token and position embedding are copied from the teacher and frozen; the vector field (attention, MLP,
    two CenterNorms), the 10 registers and a 100-class head train."""
    model = timm.create_model(name, device='meta', num_classes=PAPER_NUM_CLASSES)
    for frozen in (model.patch_embed, model.cls_token, model.pos_embed):
        frozen.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def grid_table() -> str:
    """The family grid: depth setting (rows) by token mixer (columns), from the one family table."""
    mixers = {'attention': 'dense attention', 'ssog': 'SSoG'}
    depths = {'discrete': 'discrete (L blocks)', 'looped': 'looped (one block, L times)',
              'ode': 'continuous (ODE)'}
    rows = ['| depth \\ mixer | ' + ' | '.join(mixers.values()) + ' |', '|---|' + '---|' * len(mixers)]
    for depth, label in depths.items():
        cells = [', '.join(f'`{f.name}_*`' for f in FAMILIES.values() if f.depth == depth and f.mixer == m)
                 for m in mixers]
        rows.append(f'| {label} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(rows)


def zoo_table(sizes: List[str]) -> str:
    """Params, GMACs (one image at the model's default size) and NFE of every family at each size."""
    rows = ['| model | mixer | depth | dense twin | params (M) | GMACs | NFE |', '|---|---|---|---|---:|---:|---:|']
    for size in sizes:
        for family in FAMILIES.values():
            name = model_name(family.name, size)
            model = timm.create_model(name).eval()
            img = model.pretrained_cfg['input_size'][-1]
            params = sum(p.numel() for p in model.parameters()) / 1e6
            twin = f'`{model_name(family.twin, size)}`' if family.twin else ''
            rows.append(f'| `{name}` | {family.mixer} | {family.depth} | {twin} | {params:.2f} | '
                        f'{count_gmacs(model, img):.2f} | {model.nfe} |')
    return '\n'.join(rows)


def reduction_table(sizes: List[str]) -> str:
    rows = ['| SSoG model | dense twin | fewer params |', '|---|---|---:|']
    for size in sizes:
        for family in FAMILIES.values():
            if family.twin is not None:
                for small_image in (False, True):
                    a, b = model_name(family.name, size, small_image), model_name(family.twin, size, small_image)
                    rows.append(f'| `{a}` | `{b}` | {param_reduction(a, b):.1f}% |')
    return '\n'.join(rows)


def paper_table() -> str:
    rows = ['| config | trainable params (paper count) | paper | difference |', '|---|---:|---:|---:|']
    for name, target in PAPER_CONFIGS.items():
        n = paper_trainable_params(name)
        rows.append(f'| `{name}` | {n / 1e6:.3f}M | {target / 1e6:.1f}M | {100 * (n - target) / target:+.1f}% |')
    return '\n'.join(rows)


TABLES = {'grid': grid_table, 'params': zoo_table, 'reduction': reduction_table, 'paper': paper_table}


def _main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m timm_odevit_tools.zoo',
                                     description='Print one zoo table (Markdown).')
    parser.add_argument('table', choices=sorted(TABLES))
    parser.add_argument('--sizes', nargs='+', default=list(SIZES), choices=SIZES, help='for params and reduction')
    args = parser.parse_args(argv)
    fn = TABLES[args.table]
    print(fn(args.sizes) if args.table in ('params', 'reduction') else fn())


if __name__ == '__main__':
    _main()
