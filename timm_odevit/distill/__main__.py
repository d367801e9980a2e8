"""``python -m timm_odevit.distill``: train an ODE / looped student guided by a discrete teacher's trajectory.

Without ``--teacher`` it trains the model alone (timm's ``ClassificationTask``) with the same recipe: that is how the
teacher and the from-scratch baseline are trained. Multi-process: ``torchrun --nproc_per_node N -m
timm_odevit.distill ...`` (DDP; gloo on CPU; the teacher is never wrapped or updated).
"""
import argparse
import ast
import hashlib
import json
import logging
import os
import time
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import timm
from timm.data import create_loader, resolve_data_config
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.task import ClassificationTask, DistillationTeacher, load_task_ema_checkpoint, resume_task_checkpoint
from timm.utils import (
    AverageMeter, CheckpointSaver, accuracy, dispatch_clip_grad, get_outdir,
    random_seed, setup_default_logging, unwrap_model, update_summary,
)
from timm.utils.distributed import init_distributed_device_so

import timm_odevit  # noqa: F401  (registers the student models)
from ..data import FASHION_MNIST_MEAN, FASHION_MNIST_STD
from .data import build_dataset
from .task import LOSS_KEYS, TrajectoryDistillationTask
from .times import indices_to_times

_logger = logging.getLogger('timm_odevit.distill')


def _kwargs(items: Optional[Sequence[str]]) -> Dict[str, Any]:
    """['depth=6', 'ode_method=rk4'] -> {'depth': 6, 'ode_method': 'rk4'} (values parsed as Python literals)."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition('=')
        if not sep:
            raise ValueError(f'Expected key=value, got {item!r}.')
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _floats(text: str) -> List[float]:
    return [float(v) for v in text.split(',') if v.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog='python -m timm_odevit.distill', description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group('models')
    g.add_argument('--model', default='odevit_tiny_patch4_32', help='student (any timm_odevit model)')
    g.add_argument('--model-kwargs', nargs='*', default=[], metavar='K=V', help='e.g. depth=6 ode_steps=12')
    g.add_argument('--teacher', default=None,
                   help='teacher: a timm name (vit_*, dense_vit_*, ssog_vit_*) or hf-hub:org/repo; none = train alone')
    g.add_argument('--teacher-checkpoint', default='', help='weights for the teacher (a checkpoint this command saved)')
    g.add_argument('--teacher-kwargs', nargs='*', default=[], metavar='K=V', help='e.g. img_size=32 patch_size=4')
    g.add_argument('--num-classes', type=int, default=10)
    g.add_argument('--in-chans', type=int, default=3, choices=(1, 3),
                   help='1 trains on grey images (Fashion-MNIST as it is), 3 on RGB copies (what a teacher expects)')
    g = p.add_argument_group('data')
    g.add_argument('--dataset', default='fashion_mnist',
                   help="'fashion_mnist' (built in, offline) or a timm create_dataset name ('' = image folder)")
    g.add_argument('--data-dir', default=None, help='dataset root (image folder with train/ and validation/)')
    g.add_argument('--train-split', default='train')
    g.add_argument('--val-split', default='validation')
    g.add_argument('--train-samples', type=int, default=None, help='train on a fixed random subset of this size')
    g.add_argument('--val-samples', type=int, default=None)
    g.add_argument('--mean', type=float, nargs='+', default=None, help="input mean (default: the model cfg's)")
    g.add_argument('--std', type=float, nargs='+', default=None, help="input std (default: the model cfg's)")
    g.add_argument('--aug', action='store_true', help="timm's default training augmentation (the paper uses none)")
    g.add_argument('--workers', type=int, default=0)
    g = p.add_argument_group('distillation')
    g.add_argument('--times', default='uniform', help="'uniform', 'paper', or comma-separated student times")
    g.add_argument('--time-indices', default=None, help='comma-separated solver grid indices instead of times')
    g.add_argument('--teacher-indices', default=None, help='teacher blocks to distil (comma list, or n = last n)')
    g.add_argument('--state-tokens', default='cls', choices=('cls', 'all'))
    g.add_argument('--state-weight', type=float, default=0.5)
    g.add_argument('--attn-weight', type=float, default=None,
                   help='CLS attention L1 weight (default 0.25 when both models have attention maps, else 0)')
    g.add_argument('--kd-weight', type=float, default=0.)
    g.add_argument('--kd-temperature', type=float, default=1.)
    g.add_argument('--ce-weight', type=float, default=1.)
    g.add_argument('--ce-start-epoch', type=int, default=0)
    g.add_argument('--jasmin-weight', type=float, default=None,
                   help='JaSMin weight (default 1 when the student has attention maps, else 0)')
    g.add_argument('--jasmin-k', type=int, default=2)
    g.add_argument('--jasmin-detach', action='store_true', help="released ODE-ViT code's detached JaSMin (no grad)")
    g.add_argument('--no-init-from-teacher', action='store_true', help='do not copy stem and head from the teacher')
    g.add_argument('--freeze-copied', action='store_true', help='freeze the parts copied from the teacher')
    g = p.add_argument_group('optimisation')
    g.add_argument('--epochs', type=int, default=10)
    g.add_argument('--batch-size', type=int, default=64)
    g.add_argument('--opt', default='adamw')
    g.add_argument('--lr', type=float, default=1e-3)
    g.add_argument('--weight-decay', type=float, default=0.05)
    g.add_argument('--sched', default='cosine')
    g.add_argument('--warmup-epochs', type=int, default=0)
    g.add_argument('--min-lr', type=float, default=1e-5)
    g.add_argument('--clip-grad', type=float, default=1.0)
    g.add_argument('--model-ema', action='store_true')
    g.add_argument('--model-ema-decay', type=float, default=0.998)
    g.add_argument('--max-steps-per-epoch', type=int, default=None, help='cut each epoch short (smoke runs)')
    g = p.add_argument_group('run')
    g.add_argument('--output', default='./output/distill')
    g.add_argument('--experiment', default='')
    g.add_argument('--resume', default='', help='checkpoint to continue from (model, optimizer, epoch, EMA, task)')
    g.add_argument('--checkpoint-hist', type=int, default=3)
    g.add_argument('--seed', type=int, default=42)
    g.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    g.add_argument('--log-interval', type=int, default=50)
    return p.parse_args(argv)


def _state_digest(module: torch.nn.Module) -> str:
    """A hash of every tensor in a state dict: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for k, v in unwrap_model(module).state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_task(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """Student, teacher and task from the command line."""
    student = timm.create_model(args.model, num_classes=args.num_classes, in_chans=args.in_chans,
                                **_kwargs(args.model_kwargs))
    if not args.teacher:
        return ClassificationTask(student, device=device)
    t_kwargs = _kwargs(args.teacher_kwargs)
    if args.teacher.startswith('hf-hub:'):
        teacher = timm.create_model(args.teacher, pretrained=True, checkpoint_path=args.teacher_checkpoint, **t_kwargs)
    else:
        t_kwargs.setdefault('num_classes', args.num_classes)
        teacher = timm.create_model(args.teacher, checkpoint_path=args.teacher_checkpoint, **t_kwargs)
    teacher = DistillationTeacher(teacher, device=device)
    mixer = student.trunk.field_blocks()[-1].mixer
    has_maps = bool(getattr(mixer, 'supports_attn_maps', False))
    times: Any = args.times
    if args.time_indices:
        times = indices_to_times([int(i) for i in args.time_indices.split(',')], student).tolist()
    elif args.times not in ('uniform', 'paper'):
        times = _floats(args.times)
    teacher_indices = None
    if args.teacher_indices:
        vals = [int(v) for v in args.teacher_indices.split(',')]
        teacher_indices = vals[0] if len(vals) == 1 else vals
    return TrajectoryDistillationTask(
        student, teacher,
        teacher_indices=teacher_indices,
        times=times,
        state_tokens=args.state_tokens,
        state_loss_weight=args.state_weight,
        attn_loss_weight=(0.25 if has_maps else 0.) if args.attn_weight is None else args.attn_weight,
        kd_loss_weight=args.kd_weight,
        kd_temperature=args.kd_temperature,
        task_loss_weight=args.ce_weight,
        task_loss_start_epoch=args.ce_start_epoch,
        jasmin_weight=(1. if has_maps else 0.) if args.jasmin_weight is None else args.jasmin_weight,
        jasmin_k=args.jasmin_k,
        jasmin_detach=args.jasmin_detach,
        init_from_teacher=not args.no_init_from_teacher,
        freeze_copied=args.freeze_copied,
        device=device,
    )


def _input_stats(args: argparse.Namespace, data_cfg: Dict[str, Any]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Normalisation for the inputs: --mean/--std, else the model cfg's, else (grey Fashion-MNIST) the dataset's."""
    mean = tuple(args.mean) if args.mean else tuple(data_cfg['mean'])
    std = tuple(args.std) if args.std else tuple(data_cfg['std'])
    if args.in_chans == 1 and args.dataset == 'fashion_mnist':
        mean = mean if args.mean else FASHION_MNIST_MEAN
        std = std if args.std else FASHION_MNIST_STD
    if len(mean) != args.in_chans or len(std) != args.in_chans:
        raise ValueError(f'--in-chans {args.in_chans} needs {args.in_chans} mean and std values, got mean {mean} and '
                         f'std {std}: pass --mean and --std.')
    return mean, std


@torch.no_grad()
def validate(model: torch.nn.Module, loader: Any, device: torch.device, distributed: bool) -> Dict[str, float]:
    """Top-1 and CE loss, summed over ranks."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        sums[0] += torch.nn.functional.cross_entropy(logits, y, reduction='sum').double()
        sums[1] += accuracy(logits, y, topk=(1,))[0].double() * len(y) / 100.
        sums[2] += len(y)
    if distributed:
        dist.all_reduce(sums)
    return {'loss': float(sums[0] / sums[2]), 'top1': float(100. * sums[1] / sums[2])}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Train; returns the final metrics (also written to ``results.json`` in the run folder)."""
    args = parse_args(argv)
    setup_default_logging()
    info = init_distributed_device_so(device=args.device)
    device, distributed = torch.device(info['device']), info['distributed']
    rank, world = info['global_rank'], info['world_size']
    primary = rank == 0

    # one seed for model creation on every rank: the teacher (never synchronised by DDP) must be the same everywhere
    random_seed(args.seed, 0)
    task = build_task(args, device).to(device)
    student = unwrap_model(task.get_eval_model())
    # inputs are normalised as the trained model's cfg says; a distillation task re-normalises them for the teacher
    # (DistillationTeacher.normalize_input), so a teacher trained here by this command sees what it was trained on
    data_cfg = resolve_data_config({}, model=student)
    if hasattr(student, 'patch_embed') and getattr(student.patch_embed, 'img_size', None):
        # a model built with img_size=32 keeps its 224-px pretrained cfg: the built size is what it accepts
        data_cfg['input_size'] = (args.in_chans, *student.patch_embed.img_size)
    mean, std = _input_stats(args, data_cfg)
    random_seed(args.seed, rank)  # per-rank randomness from here on (dropout, augmentation)

    mode = 'L' if args.in_chans == 1 else 'RGB'
    ds_train = build_dataset(args.dataset, args.data_dir, args.train_split, args.train_samples, seed=args.seed,
                             mode=mode)
    ds_eval = build_dataset(args.dataset, args.data_dir, args.val_split, args.val_samples, seed=args.seed + 1,
                            mode=mode)
    loader_args = dict(input_size=data_cfg['input_size'], mean=mean, std=std, num_workers=args.workers,
                       distributed=distributed, device=device, use_prefetcher=False, crop_pct=1.0,
                       persistent_workers=False)
    loader_train = create_loader(ds_train, batch_size=args.batch_size, is_training=True, no_aug=not args.aug,
                                 **loader_args)
    loader_eval = create_loader(ds_eval, batch_size=args.batch_size, is_training=False, **loader_args)

    optimizer = create_optimizer_v2(task.get_trainable_module(), opt=args.opt, lr=args.lr,
                                    weight_decay=args.weight_decay)
    start_epoch = 0
    if args.resume:
        start_epoch = resume_task_checkpoint(task, args.resume, optimizer=optimizer, log_info=primary) or 0
    if args.model_ema:
        task.setup_ema(decay=args.model_ema_decay)
        if args.resume:
            load_task_ema_checkpoint(task, args.resume)
    if distributed:
        task.prepare_distributed()

    updates_per_epoch = len(loader_train) if args.max_steps_per_epoch is None else \
        min(len(loader_train), args.max_steps_per_epoch)
    scheduler, num_epochs = create_scheduler_v2(
        optimizer, sched=args.sched, num_epochs=args.epochs, warmup_epochs=args.warmup_epochs, min_lr=args.min_lr,
        step_on_epochs=False, updates_per_epoch=updates_per_epoch)  # lr moves every step: short runs need it
    if start_epoch > 0:
        scheduler.step_update(num_updates=start_epoch * updates_per_epoch)

    output_dir, saver = None, None
    if primary:
        name = args.experiment or '-'.join([datetime.now().strftime('%Y%m%d-%H%M%S'), args.model,
                                            'guided' if args.teacher else 'alone'])
        output_dir = get_outdir(args.output, name)
        saver = CheckpointSaver(model=student, optimizer=optimizer, args=args, task=task, checkpoint_dir=output_dir,
                                recovery_dir=output_dir, decreasing=False, max_history=args.checkpoint_hist)
        if args.resume and os.path.dirname(os.path.abspath(args.resume)) == os.path.abspath(output_dir):
            saver.load_state_dict_from_checkpoint(args.resume)
        n_train = sum(p.numel() for p in task.get_trainable_module().parameters() if p.requires_grad)
        _logger.info(f'{args.model} ({n_train / 1e6:.3f}M trainable) '
                     f"{'guided by ' + args.teacher if args.teacher else 'trained alone'}, {world} process(es), "
                     f'epochs {start_epoch}..{num_epochs - 1}, {updates_per_epoch} steps each, output {output_dir}')

    eval_metrics: Dict[str, float] = {}
    num_updates = start_epoch * updates_per_epoch
    for epoch in range(start_epoch, num_epochs):
        if distributed and hasattr(loader_train.sampler, 'set_epoch'):
            loader_train.sampler.set_epoch(epoch)
        if hasattr(task, 'set_epoch'):
            task.set_epoch(epoch)
        task.train()
        meters = {k: AverageMeter() for k in ('loss',) + (LOSS_KEYS if args.teacher else ())}
        t0 = time.time()
        for step, (x, y) in enumerate(loader_train):
            if step >= updates_per_epoch:
                break
            x, y = x.to(device), y.to(device)
            out = task(x, y)
            optimizer.zero_grad(set_to_none=True)
            out['loss'].backward()
            if args.clip_grad:
                dispatch_clip_grad(task.get_clip_parameters(), args.clip_grad)
            optimizer.step()
            num_updates += 1
            task.update_ema(step=num_updates)
            scheduler.step_update(num_updates=num_updates)
            for k, m in meters.items():
                m.update(float(out[k].detach()), x.shape[0])
            if primary and (step % args.log_interval == 0 or step == updates_per_epoch - 1):
                terms = ' '.join(f'{k} {m.avg:.4f}' for k, m in meters.items())
                rate = (step + 1) * x.shape[0] * world / (time.time() - t0)
                _logger.info(f'epoch {epoch} [{step + 1}/{updates_per_epoch}] {terms} '
                             f"lr {optimizer.param_groups[0]['lr']:.2e} {rate:.0f} img/s")
        eval_metrics = validate(task.get_eval_model(), loader_eval, device, distributed)
        if task.has_ema():
            ema_metrics = validate(task.get_eval_model(ema=True), loader_eval, device, distributed)
            eval_metrics.update({'ema_' + k: v for k, v in ema_metrics.items()})
        scheduler.step(epoch + 1, eval_metrics['top1'])
        if primary:
            _logger.info(f"epoch {epoch} val top1 {eval_metrics['top1']:.2f} loss {eval_metrics['loss']:.4f} "
                         f'({time.time() - t0:.0f} s)')
            saver.save_checkpoint(epoch, metric=eval_metrics['top1'])
            update_summary(epoch, {k: m.avg for k, m in meters.items()}, eval_metrics,
                           os.path.join(output_dir, 'summary.csv'), lr=optimizer.param_groups[0]['lr'])

    digest = _state_digest(task.get_eval_model())
    digests = [digest]
    if distributed:
        # every rank reports its weights' hash: DDP training must leave them bit-identical
        digests = [None] * world
        dist.all_gather_object(digests, digest)
    results = {'model': args.model, 'teacher': args.teacher, 'epochs': num_epochs, 'world_size': world,
               'output_dir': output_dir, 'rank_state_sha256': digests, **eval_metrics}
    if primary:
        with open(os.path.join(output_dir, 'results.json'), 'w') as f:
            json.dump(results, f, indent=2)
        _logger.info(f'done: {json.dumps(results)}')
    if distributed:
        dist.destroy_process_group()
    return results


if __name__ == '__main__':
    main()
