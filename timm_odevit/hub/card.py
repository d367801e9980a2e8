"""Model cards: the one renderer of a weight's card (what, data, training recipe with the command that reruns it,
measured top-1 with the command that measures it, size, usage), in the form timm's ``generate_readme`` takes."""
from typing import Any, Dict, Optional

from torch import nn

from . import hub_id
from ..data import AUGMENT_SHIFT
from ..train import format_command

__all__ = ['DATASET', 'training_lines', 'evaluate_command', 'model_card']

DATASET = 'Fashion-MNIST'


def evaluate_command(folder: str, data: str, solver: Optional[str] = None) -> str:
    """The command that measures a card's top-1: ``python -m timm_odevit.hub evaluate``."""
    return f'python -m timm_odevit.hub evaluate {folder} --data {data}' + (f' --solver {solver}' if solver else '')


def training_lines(args: Dict[str, Any], cfg: Dict[str, Any], threads: int = 1) -> Dict[str, str]:
    """One run of ``python -m timm_odevit.train`` (its options as a dict) as card lines: data, schedule, model
    kwargs and the command that reruns it."""
    size = cfg['input_size']
    kwargs = args.get('model_kwargs') or {}
    return {
        'data': f'{args.get("train_samples") or 60000} Fashion-MNIST training images (a fixed subset seeded '
                f'{args["seed"]}), resized 28 -> {size[-1]} px, {size[0]} channel(s), normalised mean '
                f'{cfg["mean"]} / std {cfg["std"]}, '
                + (f'random horizontal flip and shift of up to {AUGMENT_SHIFT} px' if args.get('augment')
                   else 'no augmentation'),
        'schedule': f'{args["epochs"]} epochs, batch {args["batch_size"]}, {args.get("opt", "adamw")} lr {args["lr"]} '
                    f'weight decay {args["weight_decay"]}, {args["warmup_epochs"]} warm-up epoch(s) then '
                    f'{args.get("sched", "cosine")} per step to {args["min_lr"]}, grad clip {args["clip_grad"]}, '
                    f'{"bf16 autocast" if args.get("amp") == "bf16" else "fp32"}'
                    + (', EMA weights' if args.get('model_ema') else ''),
        'model kwargs while training': ', '.join(f'{k}={v}' for k, v in kwargs.items())
                                       or 'none (the registered defaults)',
        'command': f'`{format_command(args, threads)}`',
    }


def model_card(
        arch: str,
        tag: str,
        model: nn.Module,
        metrics: Dict[str, Any],
        recipe: Optional[Dict[str, Any]] = None,
        description: Optional[str] = None,
) -> Dict[str, Any]:
    """The card as timm's generate_readme takes it (what, data, recipe, top-1 with its command, size, usage).

    ``recipe``: the training run's lines (``training_lines``), or None for weights of unknown provenance.
    """
    from ..benchmark.runner import count_gmacs
    size = model.pretrained_cfg['input_size']
    params = sum(p.numel() for p in model.parameters())
    rid = hub_id(arch, tag)
    details: Dict[str, Any] = {
        'Model Type': 'Image classification',
        'Architecture': f'`{arch}` from timm_odevit (registered in timm on `import timm_odevit`)',
        'Params (M)': f'{params / 1e6:.3f}',
        'GMACs': f'{count_gmacs(model, size[-1]):.4f}',
        'Image size': f'{size[-1]} x {size[-2]}, {size[0]} channel(s)',
        'Dataset': DATASET,
        'License': 'apache-2.0',
    }
    if recipe:
        details['Training recipe'] = dict(recipe)
    results = {}
    for name, m in metrics.items():
        results[name] = (f'top-1 {m["top1"]:.2f}% ({m["correct"]}/{m["n"]}), reproduce with '
                         f'`{m["command"]}`')
    details['Measured'] = results
    usage = (
        '```python\nimport timm, timm_odevit, torch\n\n'
        f"model = timm.create_model('{arch}.{tag}', pretrained=True).eval()   # or 'hf-hub:{rid}'\n"
        "cfg = timm.data.resolve_data_config(model=model)\n"
        "transform = timm.data.create_transform(**cfg)                  "
        f"# grey PIL image in, {size[0]}x{size[1]}x{size[2]} out\n"
        "# timm's validate.py: python -m timm_odevit.run validate.py --dataset torch/fashion_mnist \\\n"
        f"#   --data-dir DATA --split test --model {arch}.{tag} --pretrained --in-chans 1\n```\n")
    return {
        'tags': ['image-classification', 'timm', 'timm_odevit'],
        'license': 'apache-2.0',
        'description': description or (
            f'`{arch}` trained from scratch on {DATASET} (28x28 grey clothing images, 10 classes, resized to '
            f'{size[-1]} px) on a CPU; the training recipe and the measured top-1 are below.'),
        'details': details,
        'usage': usage,
    }
