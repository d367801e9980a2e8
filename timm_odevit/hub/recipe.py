"""The CPU recipe behind the published discrete SSoG weights: tiny 32 px models on (a subset of) Fashion-MNIST.

One fixed, seeded recipe, so that a weight's model card can state it and anyone can rerun it (``init_checkpoint``
continues from an earlier run's weights with a fresh schedule; the checkpoint records every stage of the chain):
1-channel 32 px input (Fashion-MNIST resized with timm's eval transform, bicubic, crop_pct 1.0, normalised with the
training-set mean/std), ``n_train`` training images drawn with ``seed``, batch 128, AdamW (timm's
create_optimizer_v2, lr 2e-3, weight decay 0.05, no decay on norms/biases/tokens), linear warm-up over the first 10%
of steps then cosine to 0, gradient clipping at 1.0, no augmentation, fp32, ``torch.manual_seed(seed)``.
"""
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

import timm

from .. import data as fm
from ..models.pretrained import FMNIST_CFG

__all__ = ['Recipe', 'FMNIST_PRETRAINED_CFG', 'build_for_fmnist', 'train', 'evaluate']

_logger = logging.getLogger(__name__)

FMNIST_TRAIN_SIZE = 60000

# what the published fmnist weights expect: 1 grey channel at 32 px, the dataset's own statistics
FMNIST_PRETRAINED_CFG = FMNIST_CFG


@dataclass
class Recipe:
    """Hyper-parameters of one training run (all of them end up in the model card)."""
    n_train: int = 3072
    epochs: int = 2
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_frac: float = 0.1
    clip_grad: float = 1.0
    seed: int = 0
    threads: int = 1
    init_checkpoint: str = ''  # continue from the weights of an earlier run of this recipe (a fresh schedule)


def build_for_fmnist(arch: str, **kwargs: Any) -> nn.Module:
    """A fresh ``arch`` for 1-channel 32 px, 10 classes, carrying the Fashion-MNIST pretrained cfg."""
    model = timm.create_model(arch, pretrained=False, num_classes=10, in_chans=1, **kwargs)
    model.pretrained_cfg = dict(model.pretrained_cfg, **FMNIST_PRETRAINED_CFG)
    return model


def train(
        arch: str,
        recipe: Recipe,
        src: Optional[str] = None,
        log_every: int = 8,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """Train ``arch`` with ``recipe``; returns the model and a log (losses, images/s, wall time)."""
    from timm.optim import create_optimizer_v2
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    model = build_for_fmnist(arch)
    if recipe.init_checkpoint:
        ckpt = torch.load(recipe.init_checkpoint, map_location='cpu', weights_only=True)
        if ckpt.get('arch') != arch:
            raise ValueError(f'{recipe.init_checkpoint} holds {ckpt.get("arch")!r} weights, not {arch!r}.')
        model.load_state_dict(ckpt['state_dict'])
    g = torch.Generator().manual_seed(recipe.seed)
    # the subset: the first n_train of a seeded permutation of the 60,000 training images (of the images there are,
    # for a smaller IDX folder: the published weights used the full set, so their subsets are unchanged)
    n_avail = fm.split_size(src, 'train')
    idx = torch.randperm(FMNIST_TRAIN_SIZE, generator=g)
    idx = idx[idx < n_avail][:recipe.n_train]
    x, y = fm.load_tensors(src, 'train', model=model, indices=idx.tolist())
    steps_per_epoch = math.ceil(len(x) / recipe.batch_size)
    total = steps_per_epoch * recipe.epochs
    warm = max(1, int(recipe.warmup_frac * total))
    opt = create_optimizer_v2(model, 'adamw', lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    crit = nn.CrossEntropyLoss()
    log: Dict[str, Any] = {'losses': [], 'recipe': asdict(recipe)}
    t0 = time.time()
    step = 0
    model.train()
    for epoch in range(recipe.epochs):
        perm = torch.randperm(len(x), generator=g)
        for b in range(steps_per_epoch):
            bi = perm[b * recipe.batch_size:(b + 1) * recipe.batch_size]
            loss = crit(model(x[bi]), y[bi])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad)
            opt.step()
            sched.step()
            step += 1
            if step % log_every == 0 or step == total:
                el = time.time() - t0
                _logger.info('%s epoch %d step %d/%d loss %.4f %.1f img/s', arch, epoch, step, total, loss.item(),
                             step * recipe.batch_size / el)
                log['losses'].append((step, round(loss.item(), 4)))
    log['train_seconds'] = round(time.time() - t0, 1)
    log['images_per_second'] = round(total * recipe.batch_size / log['train_seconds'], 1)
    model.eval()
    return model, log


@torch.no_grad()
def evaluate(model: nn.Module, src: Optional[str] = None, split: str = 'test', batch_size: int = 250) -> Dict[str, Any]:
    """Top-1 (percent) of ``model`` on a Fashion-MNIST split, preprocessed with timm's eval transform for it."""
    model.eval()
    x, y = fm.load_tensors(src, split, model=model)
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += (model(x[i:i + batch_size]).argmax(-1) == y[i:i + batch_size]).sum().item()
    return {'top1': round(100. * correct / len(x), 2), 'correct': correct, 'n': len(x)}


def train_to_checkpoint(arch: str, recipe: Recipe, out: str, src: Optional[str] = None) -> Path:
    """Train and save ``{'state_dict', 'arch', 'recipe', 'log', 'pretrained_cfg'}`` to ``out`` (torch.save)."""
    model, log = train(arch, recipe, src)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    stages = [asdict(recipe)]
    if recipe.init_checkpoint:
        prev = torch.load(recipe.init_checkpoint, map_location='cpu', weights_only=True)
        stages = (prev['recipe'].get('stages') or [prev['recipe']]) + stages
    torch.save({'arch': arch, 'state_dict': model.state_dict(), 'recipe': dict(asdict(recipe), stages=stages),
                'log': log, 'pretrained_cfg': FMNIST_PRETRAINED_CFG}, path)
    _logger.info('%s trained in %.0f s (%.1f img/s) -> %s', arch, log['train_seconds'], log['images_per_second'], path)
    return path


def _main() -> None:
    import argparse
    p = argparse.ArgumentParser(prog='python -m timm_odevit.hub.recipe')
    p.add_argument('arch', nargs='+')
    p.add_argument('--out-dir', default='output/fmnist')
    p.add_argument('--src', default=None)
    for k, v in asdict(Recipe()).items():
        p.add_argument(f'--{k.replace("_", "-")}', type=type(v), default=v)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
    recipe = Recipe(**{k: getattr(a, k) for k in asdict(Recipe())})
    for arch in a.arch:
        train_to_checkpoint(arch, recipe, str(Path(a.out_dir) / f'{arch}.pth'), a.src)


if __name__ == '__main__':
    _main()
