"""``python -m timm_odevit_tools.train``: the one training command, on timm's stack.

A model trains alone (timm's ``ClassificationTask``), or with ``--teacher`` as a student whose depth trajectory a
discrete teacher guides (``TrajectoryDistillationTask``). Data: Fashion-MNIST offline (``--dataset fashion_mnist``,
the default; ``--data-dir`` a folder of its IDX files) or any timm ``create_dataset`` name. timm's
``create_loader``, ``create_optimizer_v2``, ``create_scheduler_v2`` (warm-up then cosine, stepped every update),
``ModelEmaV3`` (``--model-ema``) and ``CheckpointSaver`` (``--resume``). Each run gets a folder holding its command,
its log, ``summary.csv``, ``results.json`` (validation after every epoch) and its checkpoints.
Multi-process: ``torchrun --nproc_per_node N -m timm_odevit_tools.train ...`` (DDP; gloo on CPU; a teacher is never
wrapped or updated).
"""
import argparse
import contextlib
import csv
import difflib
import hashlib
import json
import logging
import math
import os
import re
import shlex
import sys
import time
from datetime import datetime
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch._inductor
import torch.distributed as dist
from torch import nn
import timm
from huggingface_hub.utils.sha import sha_fileobj
from timm.data import create_loader, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.models import load_checkpoint
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.task import (
    ClassificationTask, DistillationTeacher, LogitDistillationTask, load_task_ema_checkpoint, resume_task_checkpoint)
from timm.utils import (
    CheckpointSaver, ParseKwargs, dispatch_clip_grad, get_outdir, random_seed,
    setup_default_logging, unwrap_model, update_summary,
)
from timm.utils.distributed import init_distributed_device_so

from ..data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, DeviceBatches, augment_batch, build_dataset
from timm_odevit.distill import (LOSS_KEYS, STATE_NORMS, TrajectoryDistillationTask, find_attention_module,
                                 indices_to_times)
from ..cli import CommandFailed, run_command
from ..evaluate import evaluate
from ..files import write_failed
from timm_odevit.layers import ode_trunk
from timm_odevit.models import DepthVisionTransformer
from .checkpoint import checkpoint_args, read_checkpoint, unreadable
from .solvers import RandomSolvers, fixed_grid_solver

__all__ = ['cli', 'guidance_summary', 'parse_args', 'build_task', 'distillation_options', 'format_command',
           'is_training_command', 'jasmin_on_drawn_solvers', 'main', 'read_summary', 'recorded_args', 'PROG']

_logger = logging.getLogger('timm_odevit_tools.train')
_console_logging = False

PROG = 'python -m timm_odevit_tools.train'
# what cards and runs recorded before the tools left the library; it still runs (timm_odevit/train.py forwards)
LEGACY_PROG = 'python -m timm_odevit.train'
# torch.compile's modes, from torch itself: 'reduce-overhead' and 'max-autotune' use CUDA graphs
COMPILE_MODES = tuple(torch._inductor.list_mode_options())
DISTILL_MODES = ('trajectory', 'logit')
# the options logit KD uses; every other distillation option steers the trajectory terms only
LOGIT_KD_OPTIONS = ('teacher', 'teacher_checkpoint', 'teacher_kwargs', 'distill', 'kd_weight', 'kd_temperature',
                    'ce_weight')
# where a run reads and writes and how it logs, not what it trains: a card's command leaves them out
RUN_PLACE_OPTIONS = ('output', 'experiment', 'resume', 'log_interval', 'checkpoint_hist', 'device', 'workers',
                     'data_dir')
# options a resumed run must share with its checkpoint: anything else would load into another model
ARCH_OPTIONS = ('model', 'model_kwargs', 'num_classes', 'in_chans', 'teacher')


def _floats(text: str) -> List[float]:
    return [float(v) for v in text.split(',') if v.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group('model')
    g.add_argument('--model', default='ssog_vit_tiny_patch4_32', help='any timm model (timm_odevit registers ours)')
    g.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='K=V',
                   help='constructor kwargs, e.g. depth=6 ode_steps=12')
    g.add_argument('--initial-checkpoint', default='',
                   help='start from these weights with a fresh schedule and optimizer (a checkpoint of this command)')
    g.add_argument('--num-classes', type=int, default=10)
    g.add_argument('--in-chans', type=int, default=1, choices=(1, 3),
                   help='1 trains on grey images (Fashion-MNIST as it is), 3 on RGB copies (what a teacher expects)')
    g = p.add_argument_group('data')
    g.add_argument('--dataset', default='fashion_mnist',
                   help="'fashion_mnist' (built in, offline) or a timm create_dataset name ('' = image folder)")
    g.add_argument('--data-dir', default=None,
                   help="dataset folder (fashion_mnist: its IDX files; default Debian's dataset-fashion-mnist)")
    g.add_argument('--train-split', default='train')
    g.add_argument('--val-split', default='test')
    g.add_argument('--train-samples', type=int, default=None, help='train on a fixed random subset of this size')
    g.add_argument('--val-samples', type=int, default=None, help='validate on a fixed random subset of this size')
    g.add_argument('--img-size', type=int, default=None,
                   help="input size in px (default: the size a ViT was built for, else the model cfg's, as timm's "
                        "train.py: 224 for a timm CNN)")
    g.add_argument('--mean', type=float, nargs='+', default=None, help="input mean (default: the model cfg's)")
    g.add_argument('--std', type=float, nargs='+', default=None, help="input std (default: the model cfg's)")
    g.add_argument('--augment', action='store_true',
                   help='random horizontal flip and a shift of up to 2 px per image (edge-padded)')
    g.add_argument('--workers', type=int, default=0)
    g.add_argument('--data-on-device', action='store_true',
                   help='decode both splits once and keep them on the device (a GPU outruns per-image loading)')
    g = p.add_argument_group('distillation (with --teacher)')
    g.add_argument('--teacher', default=None,
                   help='teacher: a timm name (vit_*, dense_vit_*, ssog_vit_*) or hf-hub:org/repo; none = train alone')
    g.add_argument('--teacher-checkpoint', default='', help='weights for the teacher (a checkpoint this command saved)')
    g.add_argument('--teacher-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='K=V',
                   help='e.g. img_size=32 patch_size=4')
    g.add_argument('--distill', default='trajectory', choices=DISTILL_MODES,
                   help="'trajectory': the teacher's block outputs guide the student's depth trajectory (a ViT "
                        "teacher, an odevit/ssog/looped student); 'logit': logit KD alone (timm's "
                        "LogitDistillationTask: any teacher and student sharing the label set, e.g. a CNN teacher "
                        "for a discrete ViT, as DeiT)")
    g.add_argument('--times', default='uniform', help="'uniform', 'paper', or comma-separated student times")
    g.add_argument('--time-indices', default=None, help='comma-separated solver grid indices instead of times')
    g.add_argument('--teacher-indices', default=None, help='teacher blocks to distil (comma list, or n = last n)')
    g.add_argument('--state-tokens', default='cls', choices=('cls', 'all'))
    g.add_argument('--state-norm', default='layernorm', choices=STATE_NORMS,
                   help="what the state loss compares: 'layernorm' both states LayerNorm'd (default), 'none' the raw "
                        "MSE (the paper), or another normalised distance")
    g.add_argument('--state-weight', type=float, default=0.5)
    g.add_argument('--attn-weight', type=float, default=None,
                   help='CLS attention L1 weight (default 0.25 when both models have attention maps, else 0)')
    g.add_argument('--kd-weight', type=float, default=None,
                   help='logit KD weight (default 1 when the teacher classifies into the student\'s classes, else 0)')
    g.add_argument('--kd-temperature', type=float, default=1.)
    g.add_argument('--ce-weight', type=float, default=1.)
    g.add_argument('--ce-start-epoch', type=int, default=0)
    g.add_argument('--distill-end-epoch', type=int, default=None,
                   help="the teacher's terms decay linearly to 0 at this epoch (default: never)")
    g.add_argument('--jasmin-weight', type=float, default=None,
                   help='JaSMin weight (default 1 when the student has attention maps, else 0)')
    g.add_argument('--jasmin-k', type=int, default=2)
    g.add_argument('--jasmin-detach', action='store_true', help="released ODE-ViT code's detached JaSMin (no grad)")
    g.add_argument('--no-init-from-teacher', action='store_true',
                   help='do not copy stem and head from the teacher (never over --initial-checkpoint weights)')
    g.add_argument('--freeze-copied', action='store_true', help='freeze the parts copied from the teacher')
    g = p.add_argument_group('optimisation')
    g.add_argument('--epochs', type=int, default=10)
    g.add_argument('--batch-size', type=int, default=64)
    g.add_argument('--opt', default='adamw')
    g.add_argument('--lr', type=float, default=1e-3)
    g.add_argument('--weight-decay', type=float, default=0.05)
    g.add_argument('--sched', default='cosine')
    g.add_argument('--warmup-epochs', type=int, default=0)
    g.add_argument('--warmup-lr', type=float, default=1e-5)
    g.add_argument('--min-lr', type=float, default=1e-5)
    g.add_argument('--clip-grad', type=float, default=1.0)
    g.add_argument('--smoothing', type=float, default=0.,
                   help="label smoothing of the label loss (timm's LabelSmoothingCrossEntropy), as timm's train.py")
    g.add_argument('--model-ema', action='store_true', help="keep an EMA of the weights (timm's ModelEmaV3)")
    g.add_argument('--model-ema-decay', type=float, default=0.998)
    g.add_argument('--max-steps-per-epoch', type=int, default=None, help='cut each epoch short (smoke runs)')
    g = p.add_argument_group('solver robustness (ODE models; docs/training.md#solver-robust-training)')
    g.add_argument('--solvers', default=None, metavar='M:S,...',
                   help="solve each training batch with a fixed-grid solver drawn from this list, e.g. "
                        "'euler:6,euler:12,midpoint:6,rk4:3' (default: the model's own grid); validation and export "
                        'keep the model\'s grid')
    g.add_argument('--accel-weight', type=float, default=0.,
                   help='weight of the field\'s mean squared d2x/dt2 along each solve (a stiffness penalty computed '
                        'from the evaluations the solve makes anyway)')
    g = p.add_argument_group('run')
    g.add_argument('--amp', default='', choices=('', 'bf16'),
                   help='bf16: forward and loss under bfloat16 autocast (CPU or CUDA); weights stay fp32')
    g.add_argument('--torchcompile', nargs='?', const='inductor', default=None, metavar='BACKEND',
                   help="torch.compile the trained module (backend 'inductor' when given without one)")
    g.add_argument('--torchcompile-mode', default=None, choices=COMPILE_MODES,
                   help="torch.compile mode, as timm's train.py: 'reduce-overhead' brings CUDA graphs (inductor's "
                        "default mode has none); implies --torchcompile")
    g.add_argument('--output', default='./output/train', help='parent of the run folders')
    g.add_argument('--experiment', default='', help='run folder name (default: date, model, alone/guided)')
    g.add_argument('--resume', default='', help='checkpoint to continue from (model, optimizer, epoch, EMA, task)')
    g.add_argument('--checkpoint-hist', type=int, default=3)
    g.add_argument('--seed', type=int, default=42)
    g.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    g.add_argument('--log-interval', type=int, default=50)
    return p


def distillation_options() -> Tuple[str, ...]:
    """The option names (dests) that mean something only with ``--teacher``: the parser's distillation group."""
    # argparse exposes no public list of a group's options
    group = next(g for g in _parser()._action_groups if g.title.startswith('distillation'))
    return tuple(a.dest for a in group._group_actions)


# the range of each numeric option: (lowest, highest, whether each end is allowed); None: unbounded
OPTION_RANGES: Dict[str, Tuple[Optional[float], Optional[float], bool, bool]] = {
    **{k: (1, None, True, True) for k in ('epochs', 'batch_size', 'train_samples', 'val_samples',
                                          'max_steps_per_epoch', 'img_size', 'checkpoint_hist', 'log_interval',
                                          'distill_end_epoch')},
    **{k: (0, None, True, True) for k in ('workers', 'warmup_epochs', 'weight_decay', 'warmup_lr', 'min_lr',
                                          'clip_grad', 'state_weight', 'attn_weight', 'kd_weight', 'ce_weight',
                                          'ce_start_epoch', 'jasmin_weight', 'accel_weight')},
    'lr': (0, None, True, True),  # 0 is torch's too: a stage that changes only what the schedule does not touch
    'kd_temperature': (0, None, False, True),
    'smoothing': (0, 1, True, False),
    'model_ema_decay': (0, 1, False, False),
    'jasmin_k': (2, None, True, True),
}


def _range_text(low: Optional[float], high: Optional[float], low_in: bool, high_in: bool) -> str:
    if high is None:
        return f'{"at least" if low_in else "above"} {low:g}'
    return f'in {"[" if low_in else "("}{low:g}, {high:g}{"]" if high_in else ")"}'


def _out_of_range(args: argparse.Namespace) -> Optional[str]:
    """The first numeric option outside its range (NaN included), named with the range, or None."""
    for name, (low, high, low_in, high_in) in OPTION_RANGES.items():
        value = getattr(args, name)
        if value is None:
            continue
        above = value >= low if low_in else value > low
        below = high is None or (value <= high if high_in else value < high)
        if not (above and below):  # NaN fails both
            return f'--{name.replace("_", "-")} must be {_range_text(low, high, low_in, high_in)}, got {value}.'
        if not math.isfinite(value) and name != 'clip_grad':  # --clip-grad inf: no clipping, as timm's train.py
            return f'--{name.replace("_", "-")} must be a finite number, got {value}.'
    for name, kind, text in (('times', float, "'uniform', 'paper' or comma-separated numbers (0.25,0.5,1)"),
                             ('time_indices', int, 'comma-separated integers (3,6,12)'),
                             ('teacher_indices', int, 'comma-separated integers (3,6,12), or n for the last n')):
        value = getattr(args, name)
        if value is not None and not (name == 'times' and value in ('uniform', 'paper')):
            try:
                [kind(v) for v in value.split(',')]
            except ValueError:
                return f'--{name.replace("_", "-")} must be {text}, got {value!r}.'
    if args.solvers is not None:
        try:
            [fixed_grid_solver(v) for v in args.solvers.split(',')]
        except ValueError as e:
            return f'--solvers: {e}'
    if args.warmup_epochs >= args.epochs:
        return f'--warmup-epochs {args.warmup_epochs} must be shorter than the run (--epochs {args.epochs}).'
    return None


def _check_files(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        p.error(f'--data-dir {args.data_dir} does not exist.')
    for name in ('resume', 'initial_checkpoint', 'teacher_checkpoint'):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            p.error(f'--{name.replace("_", "-")} {path}: no such checkpoint.')
        problem = unreadable(path) if path else None
        if problem:
            p.error(f'--{name.replace("_", "-")} {path}: not a readable checkpoint, truncated or corrupt ({problem}). '
                    'Give an earlier one of the run (its folder keeps checkpoint-<epoch>.pth.tar files).')


def parse_args(argv: Optional[Sequence[str]] = None, files: bool = True) -> argparse.Namespace:
    """The command line, checked: a bad value fails here, before any work, with a message naming the option.
    ``files=False`` checks the options but not the data folder and checkpoints they name (a documented command whose
    inputs an earlier command makes)."""
    p = _parser()
    args = p.parse_args(argv)
    problem = _out_of_range(args)
    if problem:
        p.error(problem)
    if not timm.is_model(args.model) and not args.model.startswith(('hf-hub:', 'local-dir:')):
        near = difflib.get_close_matches(args.model, timm.list_models(), n=3)
        p.error(f'--model {args.model}: timm knows no such model'
                + (f'; did you mean {", ".join(near)}?' if near else "; timm.list_models('*pattern*') lists them."))
    if args.teacher and args.distill == 'logit':
        defaults = {a.dest: a.default for a in p._actions}  # argparse exposes no public map of defaults
        unused = [f'--{k.replace("_", "-")}' for k in distillation_options()
                  if k not in LOGIT_KD_OPTIONS and getattr(args, k) != defaults[k]]
        if unused:
            p.error(f'{", ".join(unused)} steer trajectory distillation; --distill logit uses --kd-weight, '
                    '--kd-temperature and --ce-weight only.')
    if files:
        _check_files(p, args)
    # recorded in every checkpoint (CheckpointSaver keeps args): a card renders this command only for its own runs,
    # never for a checkpoint of timm's train.py, whose options mean other things
    args.trainer = PROG
    args.threads = torch.get_num_threads()  # for the card's budget line
    return args


def _save_checkpoint(saver: CheckpointSaver, epoch: int, top1: float, output_dir: str) -> None:
    """timm's saver writes ``tmp.pth.tar`` and renames it: a failed write leaves the earlier checkpoints whole, and
    is said as such, naming the last good one and the command that continues from it."""
    try:
        saver.save_checkpoint(epoch, metric=top1)
    except (OSError, RuntimeError) as e:
        tmp = os.path.join(output_dir, 'tmp' + saver.extension)
        if os.path.exists(tmp):
            os.remove(tmp)
        last = os.path.join(output_dir, 'last' + saver.extension)
        kept = (f'The last good checkpoint is {last} (epoch {read_checkpoint(last)["epoch"]}): free space, then '
                f'continue with --resume {last}.') if os.path.exists(last) else 'No checkpoint of this run was saved.'
        raise write_failed(f'Saving the checkpoint of epoch {epoch}', output_dir, e, kept) from e


def _options_start(argv: List[str]) -> Optional[int]:
    for prog in (PROG.split(), LEGACY_PROG.split()):
        start = next((i + len(prog) for i in range(len(argv)) if argv[i:i + len(prog)] == prog), None)
        if start is not None:
            return start
    return None


def is_training_command(command: str) -> bool:
    """Whether a recorded command line runs this training command (older cards name a former trainer)."""
    return _options_start(shlex.split(command)) is not None


def recorded_args(command: str) -> argparse.Namespace:
    """The options of a recorded command line (a run's ``command.txt`` line, a card's command), parsed but not
    checked: its data folder and checkpoints lived on the machine that ran it, not necessarily on this one."""
    argv = shlex.split(command)
    start = _options_start(argv)
    if start is None:
        raise ValueError(f'not a command of {PROG}: {command!r}')
    return _parser().parse_args(argv[start:])


def format_command(args: Dict[str, Any], threads: Optional[int] = None) -> str:
    """The command line that reruns a run (its options as a dict, e.g. a checkpoint's ``args``): the model, seed
    and every option that differs from its default, none of the run's place (output, resume, ...)."""
    parser = _parser()
    parts = ([f'OMP_NUM_THREADS={threads}'] if threads else []) + PROG.split()
    for action in parser._actions:  # argparse exposes no public list of its options
        if not action.option_strings or action.dest in RUN_PLACE_OPTIONS or action.dest not in args:
            continue
        value, flag = args[action.dest], action.option_strings[0]
        if value == action.default and action.dest not in ('model', 'seed', 'epochs'):
            continue
        if action.nargs == 0:  # a switch (store_true)
            parts += [flag] if value else []
        elif isinstance(value, dict):
            parts += [flag] + [f'{k}={v}' for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            parts += [flag] + [str(v) for v in value]
        else:
            parts += [flag, str(value)]
    return ' '.join(shlex.quote(p) for p in parts)


def build_task(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The model and its task from the command line: classification alone, or distillation with ``--teacher``."""
    try:
        model = timm.create_model(args.model, num_classes=args.num_classes, in_chans=args.in_chans,
                                  **args.model_kwargs)
    except (TypeError, ValueError) as e:
        given = ' '.join(f'{k}={v!r}' for k, v in args.model_kwargs.items())
        hint = ' (--model-kwargs takes K=V with V a Python literal, e.g. depth=6 img_size=64)' \
            if isinstance(e, TypeError) and given else ''
        raise ValueError(f'--model {args.model}' + (f' --model-kwargs {given}' if given else '')
                         + f': {e}{hint}') from e
    if args.initial_checkpoint:
        # timm's loader: EMA weights where saved, DDP / torch.compile prefixes stripped
        with torch.serialization.safe_globals([argparse.Namespace]):
            load_checkpoint(model, args.initial_checkpoint, use_ema=True)
    criterion = LabelSmoothingCrossEntropy(args.smoothing) if args.smoothing else None  # None: timm's CE
    if not args.teacher:
        return ClassificationTask(model, criterion=criterion, device=device)
    t_kwargs = dict(args.teacher_kwargs)
    if args.teacher.startswith('hf-hub:'):
        teacher = timm.create_model(args.teacher, pretrained=True, checkpoint_path=args.teacher_checkpoint, **t_kwargs)
    else:
        t_kwargs.setdefault('num_classes', args.num_classes)
        teacher = timm.create_model(args.teacher, checkpoint_path=args.teacher_checkpoint, **t_kwargs)
    same_labels = getattr(teacher, 'num_classes', None) == model.num_classes
    teacher_maps = find_attention_module(teacher) is not None  # an SSoG teacher has none
    teacher = DistillationTeacher(teacher, device=device)
    if args.distill == 'logit':
        if not same_labels:
            raise ValueError(f'--distill logit matches class scores: the teacher predicts {teacher.model.num_classes} '
                             f'classes, the student {model.num_classes}. Give the teacher --teacher-kwargs '
                             f'num_classes={model.num_classes} and weights trained on them.')
        return LogitDistillationTask(
            model, teacher, criterion=criterion, temperature=args.kd_temperature, device=device,
            distill_loss_weight=1. if args.kd_weight is None else args.kd_weight, task_loss_weight=args.ce_weight)
    if not isinstance(model, DepthVisionTransformer) or getattr(teacher.model, 'cls_token', None) is None:
        raise ValueError(f'--distill trajectory matches class-token states along a timm_odevit student\'s depth: '
                         f'{args.model} guided by {args.teacher} cannot (a CNN teacher, a student of another '
                         'family). Use --distill logit for logit KD alone.')
    mixer = model.trunk.field_blocks()[-1].mixer
    has_maps = bool(getattr(mixer, 'supports_attn_maps', False))
    times: Any = args.times
    if args.time_indices:
        times = indices_to_times([int(i) for i in args.time_indices.split(',')], model).tolist()
    elif args.times not in ('uniform', 'paper'):
        times = _floats(args.times)
    teacher_indices = None
    if args.teacher_indices:
        vals = [int(v) for v in args.teacher_indices.split(',')]
        teacher_indices = vals[0] if len(vals) == 1 else vals
    return TrajectoryDistillationTask(
        model, teacher,
        teacher_indices=teacher_indices,
        times=times,
        state_tokens=args.state_tokens,
        state_norm=args.state_norm,
        state_loss_weight=args.state_weight,
        attn_loss_weight=((0.25 if has_maps and teacher_maps else 0.) if args.attn_weight is None
                          else args.attn_weight),
        kd_loss_weight=(1. if same_labels else 0.) if args.kd_weight is None else args.kd_weight,
        kd_temperature=args.kd_temperature,
        criterion=criterion,
        task_loss_weight=args.ce_weight,
        task_loss_start_epoch=args.ce_start_epoch,
        distill_end_epoch=args.distill_end_epoch,
        jasmin_weight=(1. if has_maps else 0.) if args.jasmin_weight is None else args.jasmin_weight,
        jasmin_k=args.jasmin_k,
        jasmin_detach=args.jasmin_detach,
        # weights a run starts from (a next stage) are kept whole: the teacher's stem and head would overwrite
        # the trained ones
        init_from_teacher=not (args.no_init_from_teacher or args.initial_checkpoint),
        freeze_copied=args.freeze_copied,
        device=device,
    )


def jasmin_on_drawn_solvers(args: argparse.Namespace, task: nn.Module) -> Optional[str]:
    """A warning for ``--solvers`` with JaSMin's gradient on (a guided student with attention maps), else None.

    On a drawn coarse solve that diverges, the attention maps of the last evaluation saturate and JaSMin's gradient
    outgrows every other term's by two orders of magnitude (docs/training.md#solver-robust-training); clipped to
    ``--clip-grad``, the update is then JaSMin's alone and the field never learns that solver."""
    if not args.solvers or not isinstance(task, TrajectoryDistillationTask):
        return None
    if task.jasmin_weight <= 0 or task.jasmin_detach:
        return None
    return ('--solvers with JaSMin on the attention maps (--jasmin-weight > 0): on a coarse drawn solve that diverges '
            "its gradient is hundreds of times the other terms' and, clipped, the whole update, so the field does not "
            'learn that solver. Add --jasmin-detach (as ODE-ViT\'s released code) or --jasmin-weight 0 '
            '(docs/training.md#solver-robust-training).')


def input_stats(args: argparse.Namespace, data_cfg: Dict[str, Any]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
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


def _resumes_in(args: argparse.Namespace, folder: str) -> bool:
    """Whether this command continues the run whose checkpoint lies in ``folder`` (its record is kept there)."""
    return bool(args.resume) and os.path.dirname(os.path.abspath(args.resume)) == os.path.abspath(folder)


def _check_run_folder(args: argparse.Namespace) -> None:
    """Refuse a new run in a named folder where another run trained at least one epoch: its epochs would be appended
    to that run's summary.csv and command.txt, and its checkpoints overwritten. Resuming that run in place is fine."""
    if not args.experiment:
        return  # the default name is new each time (date and time)
    folder = os.path.join(args.output, args.experiment)
    if _resumes_in(args, folder):
        return
    held = [n for n in ('summary.csv', 'results.json', 'last.pth.tar') if os.path.isfile(os.path.join(folder, n))]
    if held:
        raise FileExistsError(f'--experiment {args.experiment}: {folder} holds another run ({", ".join(held)}). '
                              f'Continue it with --resume {os.path.join(folder, "last.pth.tar")}, or name another '
                              '--experiment.')


def _check_resume(args: argparse.Namespace) -> None:
    """Refuse a checkpoint of another architecture: its weights would load into the wrong model (an ODE model of
    another depth has the same tensors) or fail deep inside timm."""
    ckpt = read_checkpoint(args.resume)
    saved = checkpoint_args(ckpt)
    if not saved:
        saved = {'model': ckpt.get('arch')}
    mine = vars(args)
    diff = [f'--{k.replace("_", "-")} {saved[k]!r} (now {mine[k]!r})' for k in ARCH_OPTIONS
            if k in saved and saved[k] != mine[k] and (k != 'model_kwargs' or saved[k] or mine[k])]
    if diff:
        raise ValueError(f'--resume {args.resume} was trained with ' + ', '.join(diff)
                         + ': resume with the same model options, or start a new run.')


def _state_digest(module: torch.nn.Module) -> str:
    """A hash of every tensor in a state dict: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for k, v in unwrap_model(module).state_dict().items():
        h.update(k.encode())
        # reshape(-1): a 0-dim buffer (BatchNorm's num_batches_tracked) has no byte view of its own
        h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _validate(task: torch.nn.Module, loader: Any, device: torch.device, amp_dtype: Optional[torch.dtype],
              distributed: bool) -> Dict[str, Any]:
    metrics = evaluate(task.get_eval_model(), loader, device, amp_dtype, distributed=distributed)
    out = {k: metrics[k] for k in ('top1', 'loss', 'nfe')}
    if task.has_ema():
        ema = evaluate(task.get_eval_model(ema=True), loader, device, amp_dtype, distributed=distributed)
        out.update({'ema_top1': ema['top1'], 'ema_loss': ema['loss']})
    return out


def read_summary(path: str) -> List[Dict[str, float]]:
    """A run's ``summary.csv`` (one row an epoch, timm's ``update_summary`` columns: ``epoch``, ``train_*``,
    ``eval_*``, ``lr``) as numbers; a cell left empty (a metric the epoch did not have) is left out."""
    with open(path, newline='') as f:
        return [{k: float(v) for k, v in row.items() if v not in ('', None)} for row in csv.DictReader(f)]


# the line each epoch leaves in train.log, where a run stopped before its end keeps its training time
_EPOCH_LINE = re.compile(r'epoch (\d+) val top1 \S+ loss \S+ \((\d+) s training, ([\d.]+) img/s\)')


def _history_before(run_dir: str, start_epoch: int) -> List[Dict[str, Any]]:
    """The per-epoch record of the epochs a resumed run does not train again. A finished run keeps it in
    ``results.json``; a run stopped before its end (killed, out of time) never wrote that file, so its record is
    rebuilt from what every epoch leaves: ``summary.csv`` (losses, validation) and ``train.log`` (training
    seconds). Without it a resumed run's card would count the training minutes of its last stretch only."""
    results = os.path.join(run_dir, 'results.json')
    if os.path.isfile(results):
        with open(results) as f:
            history = [h for h in json.load(f).get('history', []) if h['epoch'] < start_epoch]
        if [h['epoch'] for h in history] == list(range(start_epoch)):
            return history
    timing = {}
    if os.path.isfile(os.path.join(run_dir, 'train.log')):
        with open(os.path.join(run_dir, 'train.log')) as f:
            for m in _EPOCH_LINE.finditer(f.read()):
                # a later line of the same epoch is the one that counts: the epoch was trained again after a stop
                timing[int(m.group(1))] = {'train_seconds': float(m.group(2)), 'images_per_second': float(m.group(3))}
    summary = os.path.join(run_dir, 'summary.csv')
    rows = {int(r['epoch']): r for r in read_summary(summary)} if os.path.isfile(summary) else {}
    history = []
    for epoch in range(start_epoch):
        if epoch not in rows or epoch not in timing:
            _logger.warning(f'{run_dir} keeps no record of epoch {epoch} (summary.csv, train.log): results.json '
                            'and the card will leave it out')
            continue
        metrics = {k[len('eval_'):]: v for k, v in rows[epoch].items() if k.startswith('eval_')}
        history.append({'epoch': epoch, 'train_loss': rows[epoch]['train_loss'], **timing[epoch], **metrics})
    return history


def _loss_terms(task: torch.nn.Module) -> Tuple[str, ...]:
    """The loss terms a task returns besides 'loss' (a fixed set per task: the log's columns)."""
    if isinstance(task, TrajectoryDistillationTask):
        return LOSS_KEYS
    return ('task_loss', 'kd_loss') if isinstance(task, LogitDistillationTask) else ()


def _means(sums: Dict[str, torch.Tensor], count: int) -> Dict[str, float]:
    return {k: float(v) / max(count, 1) for k, v in sums.items()}


def _run_folder(args: argparse.Namespace) -> str:
    name = args.experiment or '-'.join([datetime.now().strftime('%Y%m%d-%H%M%S'), args.model,
                                        'guided' if args.teacher else 'alone'])
    try:
        return get_outdir(args.output, name)
    except OSError as e:
        raise OSError(f'--output {args.output}: cannot make the run folder {name} there ({e.strerror or e}); give '
                      'a folder you can write to.') from e


def _check_finite(what: str, where: str, value: Optional[float] = None, module: Optional[nn.Module] = None) -> None:
    """Stop a run whose loss or weights turned NaN/Inf, before a checkpoint keeps them: one host read, made where
    the loop reads the device anyway (a logged step, an epoch's end)."""
    if module is not None:
        flags = [torch.isfinite(t).all() for t in unwrap_model(module).state_dict().values() if t.is_floating_point()]
        value = 0. if not flags or bool(torch.stack(flags).all()) else math.nan
    if value is not None and not math.isfinite(value):
        raise CommandFailed(f'training diverged: the {what} became non-finite at {where}. No checkpoint of it was '
                            'written (earlier epochs\' checkpoints are kept). Try a lower --lr (or a warm-up, '
                            '--warmup-epochs 1), keep --clip-grad on, train in fp32 (drop --amp), and check the data '
                            'for NaN or Inf values.', status=3)


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """The command as users type it: 0 when the run finished, 2 naming the option for an input that cannot work, 3
    when training diverged (``timm_odevit_tools.cli``)."""
    return run_command(main, PROG, argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Train; returns the final metrics (also written to ``results.json`` in the run folder)."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        return _train(list(sys.argv[1:] if argv is None else argv))
    finally:
        # the run's train.log handler goes with the run, also when it fails: a later run in this process (tests,
        # notebooks) would otherwise write into the failed run's log
        for handler in [h for h in root.handlers if h not in before and isinstance(h, logging.FileHandler)]:
            root.removeHandler(handler)
            handler.close()


def _data_config(args: argparse.Namespace, model: nn.Module) -> Dict[str, Any]:
    """The input size, mean and std the run feeds: the trained model's cfg, its built size, ``--img-size``."""
    # inputs are normalised as the trained model's cfg says; a distillation task re-normalises them for the teacher
    # (DistillationTeacher.normalize_input), so a teacher trained here by this command sees what it was trained on
    data_cfg = resolve_data_config({}, model=model)
    built_size = getattr(getattr(model, 'patch_embed', None), 'img_size', None)
    if built_size:
        # a model built with img_size=32 keeps its 224-px pretrained cfg: the built size is what it accepts
        data_cfg['input_size'] = (args.in_chans, *built_size)
    if args.img_size:
        patch = getattr(getattr(model, 'patch_embed', None), 'patch_size', (1, 1))[0]
        if args.img_size % patch:
            lower, upper = args.img_size - args.img_size % patch, args.img_size - args.img_size % patch + patch
            raise ValueError(f'--img-size {args.img_size} is not a multiple of {args.model}\'s patch size {patch}: '
                             f'use {lower or upper} or {upper}.')
        if built_size and tuple(built_size) != (args.img_size, args.img_size):
            raise ValueError(f'--img-size {args.img_size}: {args.model} was built for {tuple(built_size)} inputs; '
                             f'build it for this size with --model-kwargs img_size={args.img_size}.')
        data_cfg['input_size'] = (args.in_chans, args.img_size, args.img_size)
    data_cfg['mean'], data_cfg['std'] = input_stats(args, data_cfg)
    return data_cfg


def _loaders(args: argparse.Namespace, data_cfg: Dict[str, Any], device: torch.device, distributed: bool, rank: int,
             world: int) -> Tuple[Any, Iterable, Iterable]:
    """The training split and the two loaders (timm's ``create_loader``, or the splits held on the device)."""
    mode = 'L' if args.in_chans == 1 else 'RGB'
    ds_train = build_dataset(args.dataset, args.data_dir, args.train_split, args.train_samples, args.seed, mode)
    ds_eval = build_dataset(args.dataset, args.data_dir, args.val_split, args.val_samples, args.seed + 1, mode)
    loader_args = dict(input_size=data_cfg['input_size'], mean=data_cfg['mean'], std=data_cfg['std'],
                       num_workers=args.workers, distributed=distributed, device=device, use_prefetcher=False,
                       crop_pct=1.0, persistent_workers=False)
    loader_train = create_loader(ds_train, batch_size=args.batch_size, is_training=True, no_aug=True, **loader_args)
    loader_eval = create_loader(ds_eval, batch_size=args.batch_size, is_training=False, **loader_args)
    if args.data_on_device:
        # decoded through the transform create_loader gave each split; every rank holds the whole training split and
        # takes its share of each epoch's permutation, and its own share of the validation split, as loaded above
        loader_train = DeviceBatches(torch.utils.data.DataLoader(ds_train, batch_size=1024, num_workers=args.workers),
                                     device, args.batch_size, shuffle=True, seed=args.seed, rank=rank, world=world)
        loader_eval = DeviceBatches(loader_eval, device, args.batch_size, shuffle=False)
    return ds_train, loader_train, loader_eval


def _train_epoch(task: nn.Module, loader: Iterable, optimizer: torch.optim.Optimizer, scheduler: Any,
                 args: argparse.Namespace, device: torch.device, epoch: int, num_updates: int, updates_per_epoch: int,
                 world: int, primary: bool) -> Tuple[Dict[str, float], int, int]:
    """One epoch of steps: the mean losses, the images seen (all ranks) and the updates done so far."""
    amp_dtype = torch.bfloat16 if args.amp == 'bf16' else None
    task.train()
    trunk = ode_trunk(unwrap_model(task.get_eval_model()))
    solvers = RandomSolvers(args.solvers.split(','), seed=args.seed + epoch) if args.solvers else None
    if trunk is not None:
        trunk.track_acceleration = bool(args.accel_weight)
    # loss sums stay on the device: reading one back every step would stall a GPU's queue
    loss_sums = {k: torch.zeros((), device=device) for k in ('loss',) + _loss_terms(task)
                 + (('accel',) if trunk is not None and args.accel_weight else ())}
    t0 = time.time()
    seen = 0
    for step, (x, y) in enumerate(loader):
        if step >= updates_per_epoch:
            break
        x, y = x.to(device), y.to(device)
        if args.augment:
            x = augment_batch(x)
        with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None), \
                solvers.drawn(trunk) if solvers is not None else contextlib.nullcontext():
            out = task(x, y)
        if 'accel' in loss_sums:
            out = dict(out, accel=trunk.acceleration, loss=out['loss'] + args.accel_weight * trunk.acceleration)
        optimizer.zero_grad(set_to_none=True)
        out['loss'].backward()
        if args.clip_grad:
            dispatch_clip_grad(task.get_clip_parameters(), args.clip_grad)
        optimizer.step()
        num_updates += 1
        task.update_ema(step=num_updates)
        scheduler.step_update(num_updates=num_updates)
        seen += x.shape[0] * world
        for k, total in loss_sums.items():
            total += out[k].detach().float() * x.shape[0]
        if step % args.log_interval == 0 or step == updates_per_epoch - 1:
            means = _means(loss_sums, seen // world)
            _check_finite('training loss', f'step {step + 1} of epoch {epoch}', means['loss'])
        if primary and (step % args.log_interval == 0 or step == updates_per_epoch - 1):
            terms = ' '.join(f'{k} {v:.4f}' for k, v in means.items())
            _logger.info(f'epoch {epoch} [{step + 1}/{updates_per_epoch}] {terms} '
                         f"lr {optimizer.param_groups[0]['lr']:.2e} {seen / (time.time() - t0):.1f} img/s")
    return _means(loss_sums, seen // world), seen, num_updates


def guidance_summary(task: TrajectoryDistillationTask) -> Dict[str, Any]:
    """The guidance as trained, defaults resolved and 'paper' times calibrated: what a run records in its
    ``results.json`` and a model card states (teacher blocks, student times, each term's weight)."""
    student = task.trainable_module_student()
    return {
        'teacher_blocks': task.teacher_indices if task.teacher_indices is not None else 'all',
        'targets': task.num_targets,
        'time_rule': task.time_rule,
        'times': None if task.target_times is None else [round(float(t), 4) for t in task.target_times],
        'state_tokens': task.state_tokens,
        'state_norm': task.state_norm,
        'weights': {'label': task.task_loss_weight, 'state': task.state_loss_weight,
                    'attention': task.attn_loss_weight, 'logit_kd': task.kd_loss_weight,
                    'jasmin': task.jasmin_weight},
        'kd_temperature': task.kd_temperature,
        'jasmin_k': task.jasmin_k,
        'jasmin_detach': task.jasmin_detach,
        'label_loss_start_epoch': task.task_loss_start_epoch,
        'distill_end_epoch': task.distill_end_epoch,
        'copied_from_teacher': list(task.copied_params),
        'copied_frozen': bool(task.copied_params) and not any(
            p.requires_grad for n, p in student.named_parameters() if n in task.copied_params),
        'projection': unwrap_model(task.trainable_module).projection is not None,
    }


def _results(args: argparse.Namespace, task: nn.Module, device: torch.device, distributed: bool, world: int,
             num_epochs: int, output_dir: Optional[str], final: Dict[str, Any], history: List[Dict[str, Any]],
             loaded_sha256: Dict[str, str]) -> Dict[str, Any]:
    """The run's record (``results.json``): its final metrics, history, weights' hash per rank and guidance."""
    digest = _state_digest(task.get_eval_model())
    digests = [digest]
    if distributed:
        # every rank reports its weights' hash: DDP training must leave them bit-identical
        digests = [None] * world
        dist.all_gather_object(digests, digest)
    # a card names the GPU a run trained on
    device_name = torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type
    results = {'model': args.model, 'teacher': args.teacher, 'epochs': num_epochs, 'world_size': world,
               'device_name': device_name,
               'output_dir': output_dir, 'rank_state_sha256': digests, **final, 'history': history}
    results.update(loaded_sha256)
    if isinstance(task, TrajectoryDistillationTask):
        # the guidance as trained (defaults resolved, times calibrated): the card states it from here
        results['guidance'] = {'mode': 'trajectory', **guidance_summary(task),
                               'teacher_checkpoint_sha256': loaded_sha256.get('teacher_checkpoint_sha256')}
    elif isinstance(task, LogitDistillationTask):
        results['guidance'] = {'mode': 'logit', 'kd_temperature': task.temperature,
                               'weights': {'label': task.task_loss_weight, 'logit_kd': task.distill_loss_weight},
                               'teacher_checkpoint_sha256': loaded_sha256.get('teacher_checkpoint_sha256')}
    return results


def _train(argv: List[str]) -> Dict[str, Any]:
    args = parse_args(argv)
    global _console_logging
    if not _console_logging:
        # once per process: a second run (tests, notebooks) would add a second console handler, every line twice
        setup_default_logging()
        _console_logging = True
    _check_run_folder(args)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f'--device {args.device}: this machine has no CUDA device torch can use; drop --device (the '
                         'CPU).')
    if args.resume:
        _check_resume(args)
    info = init_distributed_device_so(device=args.device)
    device, distributed = torch.device(info['device']), info['distributed']
    rank, world = info['global_rank'], info['world_size']
    primary = rank == 0
    amp_dtype = torch.bfloat16 if args.amp == 'bf16' else None

    # one seed for model creation on every rank: the teacher (never synchronised by DDP) must be the same everywhere
    random_seed(args.seed, 0)
    task = build_task(args, device).to(device)
    # the weights a run starts from or is guided by, by hash: a card names them so, as their path may hold others
    # by the time it is exported or its trajectory re-measured (a weight continued in place, a re-trained teacher)
    loaded_sha256 = {}
    for name in ('initial_checkpoint', 'teacher_checkpoint'):
        if getattr(args, name):
            with open(getattr(args, name), 'rb') as f:
                loaded_sha256[f'{name}_sha256'] = sha_fileobj(f).hex()
    model = unwrap_model(task.get_eval_model())
    if (args.solvers or args.accel_weight) and ode_trunk(model) is None:
        raise ValueError(f'--solvers and --accel-weight train an ODE trunk; {args.model} has none. Use them with an '
                         'odevit_* or ssog_ode_* model.')
    warning = jasmin_on_drawn_solvers(args, task)
    if warning and primary:
        _logger.warning(warning)
    data_cfg = _data_config(args, model)
    random_seed(args.seed, rank)  # per-rank randomness from here on (dropout, augmentation)
    ds_train, loader_train, loader_eval = _loaders(args, data_cfg, device, distributed, rank, world)

    optimizer = create_optimizer_v2(task.get_trainable_module(), opt=args.opt, lr=args.lr,
                                    weight_decay=args.weight_decay)
    start_epoch = 0
    if args.resume:
        start_epoch = resume_task_checkpoint(task, args.resume, optimizer=optimizer, log_info=primary) or 0
    if args.model_ema:
        task.setup_ema(decay=args.model_ema_decay)
        if args.resume:
            load_task_ema_checkpoint(task, args.resume)
    if args.torchcompile or args.torchcompile_mode:
        # after resume (the checkpoint's keys are the plain module's) and before DDP, as timm's train.py does;
        # saved state dicts are unwrapped again, so checkpoints never carry the '_orig_mod.' prefix
        task.compile(backend=args.torchcompile or 'inductor', mode=args.torchcompile_mode)
    if distributed:
        task.prepare_distributed()

    updates_per_epoch = len(loader_train) if args.max_steps_per_epoch is None else \
        min(len(loader_train), args.max_steps_per_epoch)
    scheduler, num_epochs = create_scheduler_v2(
        optimizer, sched=args.sched, num_epochs=args.epochs, warmup_epochs=args.warmup_epochs,
        warmup_lr=args.warmup_lr, min_lr=args.min_lr, step_on_epochs=False,
        updates_per_epoch=updates_per_epoch)  # lr moves every step: short runs need it
    if start_epoch > 0:
        scheduler.step_update(num_updates=start_epoch * updates_per_epoch)

    output_dir, saver, history = None, None, []
    if primary:
        output_dir = _run_folder(args)
        file_log = logging.FileHandler(os.path.join(output_dir, 'train.log'))
        file_log.setFormatter(logging.Formatter('%(asctime)s %(message)s'))
        logging.getLogger().addHandler(file_log)
        with open(os.path.join(output_dir, 'command.txt'), 'a') as f:
            f.write(' '.join([PROG] + [shlex.quote(a) for a in argv]) + '\n')
        saver = CheckpointSaver(model=model, optimizer=optimizer, args=args, task=task, checkpoint_dir=output_dir,
                                recovery_dir=output_dir, decreasing=False, max_history=args.checkpoint_hist)
        if _resumes_in(args, output_dir):
            saver.load_state_dict_from_checkpoint(args.resume)
            history = _history_before(output_dir, start_epoch)  # the epochs before the resume stay in the record
        n_train = sum(p.numel() for p in task.get_trainable_module().parameters() if p.requires_grad)
        _logger.info(f'{args.model} ({n_train / 1e6:.3f}M trainable) '
                     f"{'guided by ' + args.teacher if args.teacher else 'trained alone'}, {world} process(es), "
                     f'{len(ds_train)} training images, epochs {start_epoch}..{num_epochs - 1}, '
                     f'{updates_per_epoch} steps each, {args.amp or "fp32"}, output {output_dir}')

    num_updates = start_epoch * updates_per_epoch
    eval_metrics: Optional[Dict[str, Any]] = None
    for epoch in range(start_epoch, num_epochs):
        if hasattr(loader_train, 'set_epoch'):
            loader_train.set_epoch(epoch)
        elif distributed and hasattr(loader_train.sampler, 'set_epoch'):
            loader_train.sampler.set_epoch(epoch)
        if hasattr(task, 'set_epoch'):
            task.set_epoch(epoch)
        # each epoch's randomness (data order, augmentation, dropout) depends on the seed and the epoch alone, so a
        # run resumed from an epoch's checkpoint continues bit for bit as the uninterrupted run would have
        random_seed(args.seed + 1000 * epoch, rank)
        t0 = time.time()
        train_losses, seen, num_updates = _train_epoch(task, loader_train, optimizer, scheduler, args, device, epoch,
                                                       num_updates, updates_per_epoch, world, primary)
        train_seconds = time.time() - t0
        _check_finite('weights', f'the end of epoch {epoch}', module=task.get_eval_model())
        if task.has_ema():
            _check_finite('EMA weights', f'the end of epoch {epoch}', module=task.get_eval_model(ema=True))
        eval_metrics = _validate(task, loader_eval, device, amp_dtype, distributed)
        scheduler.step(epoch + 1, eval_metrics['top1'])
        if primary:
            _logger.info(f"epoch {epoch} val top1 {eval_metrics['top1']:.2f} loss {eval_metrics['loss']:.4f} "
                         f'({train_seconds:.0f} s training, {seen / train_seconds:.1f} img/s)')
            history.append({'epoch': epoch, 'train_loss': train_losses['loss'], 'train_seconds': train_seconds,
                            'images_per_second': seen / train_seconds, **eval_metrics})
            _save_checkpoint(saver, epoch, eval_metrics['top1'], output_dir)
            update_summary(epoch, train_losses,
                           {k: v for k, v in eval_metrics.items() if v is not None},
                           os.path.join(output_dir, 'summary.csv'), lr=optimizer.param_groups[0]['lr'])

    if eval_metrics is None:
        # nothing left to train (a finished run resumed): its metrics are measured again, never dropped
        eval_metrics = _validate(task, loader_eval, device, amp_dtype, distributed)
    final = {**{k: v for k, v in (history[-1] if history else {}).items() if k != 'epoch'}, **eval_metrics}
    results = _results(args, task, device, distributed, world, num_epochs, output_dir, final, history, loaded_sha256)
    if primary:
        with open(os.path.join(output_dir, 'results.json'), 'w') as f:
            json.dump(results, f, indent=2)
        _logger.info(f"done: top1 {results.get('top1', float('nan')):.2f}, results in {output_dir}/results.json")
    if distributed:
        dist.destroy_process_group()
    return results
