"""Publish the study's models: the best run of each family (and any run folder of ``python -m timm_odevit.distill``)
exported to ``weights/<arch>.<tag>/`` with a card that carries its recipe and its measured top-1."""
import json
import shlex
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from .runs import SETTINGS

__all__ = ['best_runs', 'model_from_run', 'export_run']


def best_runs(root: Path) -> Dict[str, Path]:
    """arch -> the finished run folder with the highest final validation top-1 (over seeds)."""
    best: Dict[str, Path] = {}
    score: Dict[str, float] = {}
    for dense, ssog, _ in SETTINGS.values():
        for arch in (dense, ssog):
            for run_path in sorted((Path(root) / 'runs').glob(f'{arch}-seed*')):
                res = run_path / 'results.json'
                top1 = json.loads(res.read_text())['top1'] if res.is_file() else None
                if top1 is not None and top1 > score.get(arch, -1.):
                    best[arch], score[arch] = run_path, top1
    return best


def _run_args(run_path: Path) -> Dict[str, Any]:
    # the checkpoint keeps the run's argparse namespace (timm's CheckpointSaver); our own file, so unpickling is safe
    ckpt = torch.load(run_path / 'last.pth.tar', map_location='cpu', weights_only=False)
    return {'state_dict': ckpt['state_dict'], 'args': vars(ckpt['args'])}


def model_from_run(run_path: Path, pretrained_cfg: Dict[str, Any],
                   ckpt: Optional[Dict[str, Any]] = None) -> nn.Module:
    """The model at the end of a run, built as the registered architecture (default solver) with ``pretrained_cfg``;
    ``ckpt``: what ``_run_args`` already read from that run, so a caller needing both reads the file once."""
    import timm
    import timm_odevit  # noqa: F401
    ckpt = ckpt or _run_args(run_path)
    sd, args = ckpt['state_dict'], ckpt['args']
    img = pretrained_cfg['input_size'][-1]
    model = timm.create_model(args['model'], num_classes=sd['head.weight'].shape[0],
                              in_chans=sd['patch_embed.proj.weight'].shape[1], img_size=img)
    model.load_state_dict(sd)
    model.pretrained_cfg = dict(model.pretrained_cfg, **pretrained_cfg)
    return model.eval()


def _recipe_lines(args: Dict[str, Any], pretrained_cfg: Dict[str, Any]) -> Dict[str, str]:
    size = pretrained_cfg['input_size']
    flags = ['--model', args['model'], '--seed', str(args['seed'])]
    for key in ('train_samples', 'val_samples', 'epochs', 'batch_size', 'lr', 'weight_decay', 'warmup_epochs',
                'min_lr', 'clip_grad', 'in_chans'):
        if args.get(key) is not None:
            flags += [f'--{key.replace("_", "-")}', str(args[key])]
    if args.get('model_kwargs'):
        flags += ['--model-kwargs', *args['model_kwargs']]
    return {
        'data': f'{args["train_samples"] or 60000} Fashion-MNIST training images (a fixed subset seeded '
                f'{args["seed"]}), resized 28 -> {size[-1]} px, {size[0]} channel(s), normalised mean '
                f'{pretrained_cfg["mean"]} / std {pretrained_cfg["std"]}, no augmentation',
        'schedule': f'{args["epochs"]} epochs, batch {args["batch_size"]}, AdamW lr {args["lr"]} weight decay '
                    f'{args["weight_decay"]}, {args["warmup_epochs"]} warm-up epoch(s) then cosine per step to '
                    f'{args["min_lr"]}, grad clip {args["clip_grad"]}, fp32, CPU (1 thread)',
        'model kwargs while training': ', '.join(args.get('model_kwargs') or []) or 'none (the registered defaults)',
        'command': f'`OMP_NUM_THREADS=1 python -m timm_odevit.distill {shlex.join(flags)}`',
    }


def export_run(
        run_path: Path,
        tag: str,
        pretrained_cfg: Dict[str, Any],
        root: str = 'weights',
        description: Optional[str] = None,
        full_test: bool = True,
) -> Dict[str, Any]:
    """Export one run to ``root/<arch>.<tag>/``; the card's top-1 is measured here (bundled sample, full test set;
    for a model trained with other solver settings, also at those)."""
    from .. import data as fm
    from ..hub.__main__ import _evaluate_cmd
    from ..hub.export import export, model_card
    from ..hub.recipe import evaluate
    from ..distill.__main__ import _kwargs
    ckpt = _run_args(run_path)
    args = ckpt['args']
    arch = args['model']
    model = model_from_run(run_path, pretrained_cfg, ckpt)
    folder = f'{root}/{arch}.{tag}'
    sources = [('Fashion-MNIST sample (1,000 test images, bundled)', fm.SAMPLE_DIR, 'sample')]
    if full_test:
        sources.append(('Fashion-MNIST test set (10,000 images)', fm.DEBIAN_FASHION_MNIST, 'full'))
    metrics: Dict[str, Dict[str, Any]] = {}
    for name, src, key in sources:
        metrics[name] = dict(evaluate(model, str(src)), command=_evaluate_cmd(folder, key))
    trained = _kwargs(args.get('model_kwargs'))
    if 'ode_steps' in trained and trained['ode_steps'] != model.trunk.steps:
        default_steps = model.trunk.steps
        model.trunk.set_solver(steps=trained['ode_steps'])
        for name, src, key in sources:
            r = evaluate(model, str(src))
            metrics[f'{name}, solved as trained ({trained["ode_steps"]} Euler steps)'] = dict(
                r, command=_evaluate_cmd(folder, key, f'{model.trunk.method}:{trained["ode_steps"]}'))
        model.trunk.set_solver(steps=default_steps)
    card = model_card(arch, tag, model, metrics, _recipe_lines(args, pretrained_cfg), description)
    repo = export(model, arch, tag, root, card)
    return {'repo': str(repo), **{k: v['top1'] for k, v in metrics.items()}}
