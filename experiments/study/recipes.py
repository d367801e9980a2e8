"""timm ``train.py`` recipes (YAML for ``-c``), one per family: Fashion-MNIST at 32 px with the study's recipe on
the full training set, and CIFAR-100 at 224 px with the papers' settings. ``python -m experiments.study recipes``
writes them to ``examples/``; a test keeps the committed files equal to what this module writes."""
from pathlib import Path
from typing import Any, Dict, List

import yaml

from timm_odevit_tools.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD
from timm_odevit.models.families import FAMILIES
from .runs import STUDY_KWARGS, StudyRecipe

__all__ = ['fmnist_recipe', 'cifar100_recipe', 'write_recipes']

FMNIST_EPOCHS = 30


def _model_kwargs(family: str) -> Dict[str, Any]:
    return dict(STUDY_KWARGS.get(FAMILIES[family].depth, {}))


def fmnist_recipe(family: str) -> Dict[str, Any]:
    """The study's recipe (same optimiser, schedule, no augmentation) on all 60,000 images for 30 epochs."""
    r = StudyRecipe()
    cfg: Dict[str, Any] = {
        'device_modules': ['timm_odevit'],
        'dataset': 'torch/fashion_mnist', 'data_dir': 'data', 'train_split': 'train', 'val_split': 'test',
        'model': f'{family}_tiny_patch4_32', 'num_classes': 10, 'in_chans': r.in_chans, 'img_size': 32,
        'mean': list(FASHION_MNIST_MEAN), 'std': list(FASHION_MNIST_STD), 'interpolation': 'bicubic',
        'crop_pct': 1.0, 'no_aug': True, 'smoothing': 0.0,
        'opt': 'adamw', 'lr': r.lr, 'weight_decay': r.weight_decay, 'clip_grad': r.clip_grad,
        'sched': 'cosine', 'sched_on_updates': True, 'epochs': FMNIST_EPOCHS, 'warmup_epochs': r.warmup_epochs,
        'warmup_lr': 1e-5, 'min_lr': r.min_lr, 'cooldown_epochs': 0, 'batch_size': r.batch_size,
        'workers': 4, 'seed': 0, 'checkpoint_hist': 2, 'output': 'output/fmnist',
    }
    kwargs = _model_kwargs(family)
    if kwargs:
        cfg['model_kwargs'] = kwargs
    return cfg


def cifar100_recipe(family: str) -> Dict[str, Any]:
    """CIFAR-100 resized to 224 px, small width: ODE-ViT's optimisation (AdamW lr 1e-4, weight decay 0.05, batch 64,
    300 epochs, grad clip 1.0, no augmentation), which we also read as SSoG's (its text gives no recipe)."""
    cfg: Dict[str, Any] = {
        'device_modules': ['timm_odevit'],
        'dataset': 'torch/cifar100', 'data_dir': 'data/cifar100', 'dataset_download': True,
        'train_split': 'train', 'val_split': 'test',
        'model': f'{family}_small', 'num_classes': 100, 'img_size': 224,
        'mean': [0.5071, 0.4865, 0.4409], 'std': [0.2673, 0.2564, 0.2762], 'interpolation': 'bicubic',
        'crop_pct': 1.0, 'no_aug': True, 'smoothing': 0.0,
        'opt': 'adamw', 'lr': 1e-4, 'weight_decay': 0.05, 'clip_grad': 1.0,
        'sched': 'cosine', 'sched_on_updates': True, 'epochs': 300, 'warmup_epochs': 0, 'min_lr': 1e-6,
        'cooldown_epochs': 0, 'batch_size': 64, 'workers': 8, 'amp': True, 'seed': 0, 'checkpoint_hist': 2,
        'output': 'output/cifar100',
    }
    kwargs = _model_kwargs(family)
    if kwargs:
        cfg['model_kwargs'] = kwargs
    return cfg


def _text(cfg: Dict[str, Any], title: str) -> str:
    return (f'# {title}\n# run from a clone of timm: python train.py -c THIS_FILE\n'
            + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None))


def write_recipes(out_dir: Path) -> List[Path]:
    """Write ``fmnist_<family>_tiny_patch4_32.yaml`` and ``cifar100_<family>_small.yaml`` for every family."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for family in FAMILIES:
        for name, cfg, title in (
                (f'fmnist_{family}_tiny_patch4_32.yaml', fmnist_recipe(family),
                 f'{family} tiny, Fashion-MNIST 32 px: the matched study recipe on the full training set'),
                (f'cifar100_{family}_small.yaml', cifar100_recipe(family),
                 f'{family} small, CIFAR-100 at 224 px: the papers\' protocol (GPU)')):
            path = out_dir / name
            path.write_text(_text(cfg, title))
            paths.append(path)
    return paths
