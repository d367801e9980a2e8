"""The CPU recipe behind the published discrete SSoG weights: tiny 32 px models on (a subset of) Fashion-MNIST.

One fixed, seeded recipe, so that a weight's model card can state it and anyone can rerun it (``init_checkpoint``
continues from an earlier run's weights with a fresh schedule; the checkpoint records every stage of the chain):
1-channel 32 px input (Fashion-MNIST resized with timm's eval transform, bicubic, crop_pct 1.0, normalised with the
training-set mean/std), ``n_train`` training images drawn with ``seed``, batch 128, AdamW (timm's
create_optimizer_v2, lr 2e-3, weight decay 0.05, no decay on norms/biases/tokens), linear warm-up over the first 10%
of steps then cosine to 0, gradient clipping at 1.0, ``torch.manual_seed(seed)``. By default no augmentation and
fp32; ``augment`` adds a random horizontal flip and a random shift of up to ``AUGMENT_SHIFT`` pixels (edge-padded)
per image, and ``bf16`` runs forward and loss under CPU bfloat16 autocast (weights and optimizer stay fp32), 1.7-2.2x
the images/s of fp32 on this machine's AVX512-BF16 cores (``--compare-precision 5`` measures it).
"""
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

import timm

from .. import data as fm
from ..models.pretrained import FMNIST_CFG

__all__ = ['Recipe', 'FMNIST_PRETRAINED_CFG', 'build_for_fmnist', 'augment_batch', 'train_step', 'compare_precision',
           'train', 'evaluate', 'parse_command', 'recipe_command']

_logger = logging.getLogger(__name__)

FMNIST_TRAIN_SIZE = 60000
AUGMENT_SHIFT = 2

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
    augment: bool = False
    bf16: bool = False


def build_for_fmnist(arch: str, **kwargs: Any) -> nn.Module:
    """A fresh ``arch`` for 1-channel 32 px, 10 classes, carrying the Fashion-MNIST pretrained cfg."""
    model = timm.create_model(arch, pretrained=False, num_classes=10, in_chans=1, **kwargs)
    model.pretrained_cfg = dict(model.pretrained_cfg, **FMNIST_PRETRAINED_CFG)
    return model


def augment_batch(x: torch.Tensor, generator: torch.Generator, shift: int = AUGMENT_SHIFT) -> torch.Tensor:
    """Flip each image left-right with probability 1/2, then shift it by up to ``shift`` pixels each way."""
    b, _, h, w = x.shape
    flip = torch.rand(b, generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    # edge padding: the garment's background continues, where zeros would be a bright frame after normalisation
    padded = nn.functional.pad(x, (shift,) * 4, mode='replicate')
    dy, dx = torch.randint(0, 2 * shift + 1, (2, b), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, :, None]
    cols = (dx[:, None] + torch.arange(w))[:, None, :]
    return padded[torch.arange(b)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               recipe: Recipe) -> torch.Tensor:
    """One update of the recipe (cross-entropy, clipped gradients); returns the loss."""
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=recipe.bf16):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad)
    opt.step()
    return loss


def compare_precision(arch: str, recipe: Recipe, repeats: int = 5) -> Dict[str, float]:
    """Images/s of the recipe's training step in fp32 and under bf16 autocast, medians of interleaved repeats."""
    from timm.optim import create_optimizer_v2
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    x = torch.randn(recipe.batch_size, *FMNIST_PRETRAINED_CFG['input_size'])
    y = torch.randint(0, 10, (recipe.batch_size,))
    runs, times = {}, {}
    for name, bf16 in (('fp32', False), ('bf16', True)):
        model, r = build_for_fmnist(arch), replace(recipe, bf16=bf16)
        opt = create_optimizer_v2(model, 'adamw', lr=r.lr, weight_decay=r.weight_decay)
        train_step(model, opt, x, y, r)  # warm-up: allocator, oneDNN primitives
        runs[name], times[name] = (model, opt, r), []
    for _ in range(repeats):
        for name, (model, opt, r) in runs.items():
            t0 = time.perf_counter()
            train_step(model, opt, x, y, r)
            times[name].append(time.perf_counter() - t0)
    out = {name: recipe.batch_size / statistics.median(t) for name, t in times.items()}
    out['bf16 / fp32'] = out['bf16'] / out['fp32']
    return out


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
    log: Dict[str, Any] = {'losses': [], 'recipe': asdict(recipe)}
    t0 = time.time()
    step = 0
    model.train()
    for epoch in range(recipe.epochs):
        perm = torch.randperm(len(x), generator=g)
        for b in range(steps_per_epoch):
            bi = perm[b * recipe.batch_size:(b + 1) * recipe.batch_size]
            xb = augment_batch(x[bi], g) if recipe.augment else x[bi]
            loss = train_step(model, opt, xb, y[bi], recipe)
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


def parse_command(argv: Optional[List[str]] = None) -> Tuple[List[str], str, Optional[str], Recipe, int]:
    """The command line of ``python -m timm_odevit.hub.recipe``: (archs, out_dir, src, recipe, compare repeats)."""
    import argparse
    p = argparse.ArgumentParser(prog='python -m timm_odevit.hub.recipe')
    p.add_argument('arch', nargs='+')
    p.add_argument('--out-dir', default='output/fmnist')
    p.add_argument('--src', default=None)
    for k, v in asdict(Recipe()).items():
        if isinstance(v, bool):
            p.add_argument(f'--{k.replace("_", "-")}', action=argparse.BooleanOptionalAction, default=v)
        else:
            p.add_argument(f'--{k.replace("_", "-")}', type=type(v), default=v)
    p.add_argument('--compare-precision', type=int, default=0, metavar='REPEATS',
                   help='time the training step in fp32 and bf16 autocast (interleaved, medians) instead of training')
    a = p.parse_args(argv)
    return a.arch, a.out_dir, a.src, Recipe(**{k: getattr(a, k) for k in asdict(Recipe())}), a.compare_precision


def recipe_command(arch: str, recipe: Dict[str, Any]) -> str:
    """The command line that reruns ``recipe`` (a ``Recipe`` as a dict), the inverse of ``parse_command``: the size,
    length, lr and seed always, every other option where it differs from the default, ``--init-checkpoint`` as a
    placeholder (the previous stage's file)."""
    default = asdict(Recipe())
    parts = [f'OMP_NUM_THREADS={recipe.get("threads", 1)} python -m timm_odevit.hub.recipe {arch}']
    for k, d in default.items():
        v = recipe.get(k, d)  # stages recorded before an option existed ran with its default
        flag = f'--{k.replace("_", "-")}'
        if k != 'init_checkpoint' and (k in ('n_train', 'epochs', 'lr', 'seed') or v != d):
            parts.append(flag if v is True else f'--no-{flag[2:]}' if v is False else f'{flag} {v}')
    if recipe.get('init_checkpoint'):
        parts.append("--init-checkpoint <the previous stage's .pth>")
    return ' '.join(parts)


def _main() -> None:
    archs, out_dir, src, recipe, compare = parse_command()
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
    for arch in archs:
        if compare:
            r = compare_precision(arch, recipe, compare)
            print(f'{arch} batch {recipe.batch_size}, {recipe.threads} thread(s), median of {compare}: '
                  f'fp32 {r["fp32"]:.1f} img/s, bf16 autocast {r["bf16"]:.1f} img/s, ratio {r["bf16 / fp32"]:.2f}')
            continue
        train_to_checkpoint(arch, recipe, str(Path(out_dir) / f'{arch}.pth'), src)


if __name__ == '__main__':
    _main()
