"""Model cards: the one renderer of a weight's card (what, data, training recipe with the command that reruns it,
measured top-1 with the command that measures it, size, usage), in the form timm's ``generate_readme`` takes."""
from typing import Any, Dict, List, Optional

from . import hub_id
from .revisions import source_line
from ..data import AUGMENT_SHIFT, FASHION_MNIST_TRAIN_IMAGES
from ..train import format_command

__all__ = ['DATASET', 'RECIPE', 'LOGIT_KD', 'evaluate_command', 'guidance_line', 'images_per_epoch', 'model_card',
           'staged_lines', 'training_lines', 'training_minutes']

DATASET = 'Fashion-MNIST'
RECIPE = 'Training recipe'  # the card's heading of the recipe lines
# how the teacher line of a --distill logit run names its loss
LOGIT_KD = "logit KD alone (timm's LogitDistillationTask)"


def evaluate_command(folder: str, data: str, solver: Optional[str] = None) -> str:
    """The command that measures a card's top-1: ``python -m timm_odevit_tools.hub evaluate``."""
    return (f'python -m timm_odevit_tools.hub evaluate {folder} --data {data}'
            + (f' --solver {solver}' if solver else ''))


def guidance_line(args: Dict[str, Any], guidance: Optional[Dict[str, Any]] = None,
                  teacher_from: Optional[Dict[str, Any]] = None) -> str:
    """A teacher-guided run's guidance as one card line: the teacher, where its targets sit on the student's depth
    axis and the loss as trained. ``guidance``: the run's record (``results.json``: the task's
    ``guidance_summary``, defaults resolved); without it, the options as given. ``teacher_from``: the teacher's
    weights file as ``revisions.weights_source`` names it (a published repo and revision, else a sha256)."""
    teacher = f'teacher `{args["teacher"]}`'
    if teacher_from:
        teacher += f' (weights {source_line(teacher_from)})'
    elif args.get('teacher_checkpoint'):
        teacher += f' (weights `{args["teacher_checkpoint"]}`)'
    if args.get('teacher_kwargs'):
        teacher += ', kwargs ' + ' '.join(f'{k}={v}' for k, v in dict(args['teacher_kwargs']).items())
    if args.get('distill') == 'logit':
        # no targets on a depth axis, only the class scores
        if not guidance:
            return f'{teacher}; {LOGIT_KD}; loss weights as the command gives them (the run recorded none resolved)'
        w = guidance['weights']
        return (f"{teacher}; {LOGIT_KD}: loss = {w['label']:g} x label loss + {w['logit_kd']:g} x logit KD "
                f"(T={guidance['kd_temperature']:g})")
    if not guidance:
        return teacher + '; loss weights and times as the command gives them (the run recorded no resolved values)'
    w = guidance['weights']
    terms = [(w['label'], 'label loss' + (f' (from epoch {guidance["label_loss_start_epoch"]})'
                                          if guidance['label_loss_start_epoch'] else '')),
             (w['state'], f'{guidance["state_tokens"].upper() if guidance["state_tokens"] == "cls" else "all-token"} '
                          f'state MSE (state norm {guidance["state_norm"]})'),
             (w['attention'], 'CLS attention L1'),
             (w['logit_kd'], f'logit KD (T={guidance["kd_temperature"]:g})'),
             (w['jasmin'], f'JaSMin (k={guidance["jasmin_k"]}' + (', detached' if guidance['jasmin_detach'] else '')
              + ')')]
    loss = ' + '.join(f'{weight:g} x {name}' for weight, name in terms if weight)
    times = ', '.join(f'{t:g}' for t in guidance['times']) if guidance['times'] else 'uncalibrated'
    end = guidance['distill_end_epoch']
    parts = [teacher,
             f'{guidance["targets"]} targets (teacher blocks: {guidance["teacher_blocks"]}) at student times '
             f'{times} (rule {guidance["time_rule"]})',
             f'loss = {loss}',
             'teacher terms at full weight throughout' if end is None
             else f'teacher terms decaying linearly to 0 at epoch {end}']
    if guidance['copied_from_teacher']:
        parts.append(f'initialised from the teacher: {", ".join(guidance["copied_from_teacher"])} '
                     + ('(frozen)' if guidance['copied_frozen'] else '(then trained)'))
    if guidance['projection']:
        parts.append("a learned linear projection maps the student's width to the teacher's")
    return '; '.join(parts)


def training_lines(args: Dict[str, Any], cfg: Dict[str, Any], threads: Optional[int] = None,
                   history: Optional[List[Dict[str, Any]]] = None,
                   guidance: Optional[Dict[str, Any]] = None, ema_published: bool = True,
                   device_name: Optional[str] = None, teacher_from: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """One run of ``python -m timm_odevit_tools.train`` (its options as a dict) as card lines: data, schedule, budget,
    model kwargs, the teacher guidance of a guided run and the command that reruns it. ``threads``: the run's CPU
    threads (default: what the run recorded, else 1); ``history`` and ``guidance``: its per-epoch record and its
    resolved guidance (``results.json``), for the wall time and the teacher line; ``ema_published``: whether a run
    that kept an EMA is published with its EMA weights; ``device_name``: the GPU a run recorded (``results.json``);
    ``teacher_from``: the teacher's weights file, as ``guidance_line`` takes it."""
    size = cfg['input_size']
    kwargs = args.get('model_kwargs') or {}
    threads = threads or args.get('threads') or 1
    n_train = args.get('train_samples') or FASHION_MNIST_TRAIN_IMAGES
    per_epoch = images_per_epoch(args)
    precision = 'bf16 autocast' if args.get('amp') == 'bf16' else 'fp32'
    where = f'{threads} CPU thread(s)' if args.get('device', 'cpu') == 'cpu' else \
        f'`{args["device"]}`' + (f' ({device_name})' if device_name and device_name != args['device'] else '')
    budget = f'{args["epochs"] * per_epoch:,} images seen ({args["epochs"]} epochs of {per_epoch:,})'
    minutes = training_minutes(args, history)
    if minutes is not None:
        budget += f', {minutes:.1f} min of training steps (validation aside)'
    lines = {
        'data': f'{n_train} Fashion-MNIST training images (a fixed subset seeded '
                f'{args["seed"]}), resized 28 -> {size[-1]} px, {size[0]} channel(s), normalised mean '
                f'{cfg["mean"]} / std {cfg["std"]}, '
                + (f'random horizontal flip and shift of up to {AUGMENT_SHIFT} px' if args.get('augment')
                   else 'no augmentation'),
        'schedule': f'{args["epochs"]} epochs, batch {args["batch_size"]}, {args.get("opt", "adamw")} lr {args["lr"]} '
                    f'weight decay {args["weight_decay"]}, {args["warmup_epochs"]} warm-up epoch(s) then '
                    f'{args.get("sched", "cosine")} per step to {args["min_lr"]}, grad clip {args["clip_grad"]}, '
                    + (f'label smoothing {args["smoothing"]}, ' if args.get('smoothing') else '')
                    + precision + ((', EMA weights' if ema_published else ', an EMA kept but not published: these are '
                                   'the raw weights of the last epoch') if args.get('model_ema') else ''),
        'budget': f'{budget}, {where}, {precision}',
        'model kwargs while training': ', '.join(f'{k}={v}' for k, v in kwargs.items())
                                       or 'none (the registered defaults)',
    }
    if args.get('solvers') or args.get('accel_weight'):
        lines['solver robustness'] = (
            (f'each batch solved by a fixed-grid solver drawn uniformly from {args["solvers"]}' if args.get('solvers')
             else "each batch solved on the model's grid")
            + (f', plus {args["accel_weight"]} x the mean squared d2x/dt2 along the solve' if args.get('accel_weight')
               else '') + "; validated on the model's grid")
    if args.get('teacher'):
        lines['teacher guidance'] = guidance_line(args, guidance, teacher_from)
    lines['command'] = f'`{format_command(args, threads)}`'
    return lines


def images_per_epoch(args: Dict[str, Any]) -> int:
    """Training images one epoch of a run sees (its options as a dict): its training set, or fewer where
    ``--max-steps-per-epoch`` cuts the epoch short."""
    n_train = args.get('train_samples') or FASHION_MNIST_TRAIN_IMAGES
    return min(n_train, args['max_steps_per_epoch'] * args['batch_size']) if args.get('max_steps_per_epoch') \
        else n_train


def training_minutes(args: Dict[str, Any], history: Optional[List[Dict[str, Any]]]) -> Optional[float]:
    """Minutes of training steps of a run (validation aside) from its per-epoch record; None unless the record holds
    every epoch (a run resumed without its record would undercount)."""
    if not history or sorted(h['epoch'] for h in history) != list(range(args['epochs'])):
        return None
    per_epoch = images_per_epoch(args)
    return sum(h.get('train_seconds') or per_epoch / h['images_per_second'] for h in history) / 60


def staged_lines(stages: List[Dict[str, str]]) -> Dict[str, str]:
    """The card lines of several runs in training order, each continuing from the weights of the one before, as
    one recipe whose keys name the stage ('stage 2 of 2, schedule'); a one-stage recipe keeps its keys."""
    if len(stages) == 1:
        return dict(stages[0])
    return {f'stage {i} of {len(stages)}, {k}': v for i, stage in enumerate(stages, 1) for k, v in stage.items()}


def model_card(record: Dict[str, Any], metrics: Dict[str, Any]) -> Dict[str, Any]:
    """The card as timm's generate_readme takes it (what, data, recipe, top-1 with its command, size, usage), from a
    weight's record (``hub.record.weight_record``) and its measured figures (``hub.export.measure``)."""
    name, arch, stages = record['weights'], record['architecture'], record['stages']
    size = record['input_size']
    details: Dict[str, Any] = {
        'Model Type': 'Image classification',
        'Architecture': f'`{arch}` from timm_odevit (registered in timm on `import timm_odevit`)',
        'Params (M)': f'{record["params"] / 1e6:.3f}',
        'GMACs': f'{record["gmacs"]:.4f}',
        'Image size': f'{size[-1]} x {size[-2]}, {size[0]} channel(s)',
        'Dataset': DATASET,
        'License': 'apache-2.0',
    }
    if record['solver']:
        method, steps = record['solver'].split(':')
        details['ODE solver'] = (f'{method}, {steps} steps (what `pretrained=True` gives, from '
                                 '`config.json`; `model.set_solver(method=..., steps=...)` changes it)')
    if record['stored_dtype'] != 'float32':
        details['Stored precision'] = (f'{record["stored_dtype"]} (timm loads it into a float32 model; the '
                                       'top-1 figures below are those of the stored weights)')
    if stages:
        details[RECIPE] = staged_lines([stage['lines'] for stage in stages])
    details['Measured'] = {key: f'top-1 {m["top1"]:.2f}% ({m["correct"]}/{m["n"]}), reproduce with `{m["command"]}`'
                           for key, m in metrics.items()}
    usage = (
        '```python\nimport timm, timm_odevit, torch\n\n'
        f"model = timm.create_model('{name}', pretrained=True).eval()   # or 'hf-hub:{hub_id(*name.split('.', 1))}'\n"
        "cfg = timm.data.resolve_data_config(model=model)\n"
        "transform = timm.data.create_transform(**cfg)                  "
        f"# grey PIL image in, {size[0]}x{size[1]}x{size[2]} out\n"
        "# timm's validate.py: python -m timm_odevit.run validate.py --dataset torch/fashion_mnist \\\n"
        f"#   --data-dir DATA --split test --model {name} --pretrained --in-chans 1\n```\n")
    start = 'from scratch'
    if stages and stages[0].get('initialised_from'):
        start = 'from other weights'  # its first stage started from weights whose recipe is not known
    elif stages and len(stages) > 1:
        start += f' in {len(stages)} stages, each from the weights of the one before'
    guided = [(str(i), f'{"logit" if stage["teacher"]["distill"] == "logit" else "trajectory"} distillation')
              for i, stage in enumerate(stages or [], 1) if stage.get('teacher')]
    kinds = list(dict.fromkeys(kind for _, kind in guided))
    if len(kinds) == 1:
        # which stages a teacher guided: a weight whose teacher joined late is mostly its own training
        start += f', guided by a teacher ({kinds[0]})' + (
            f' in stage{"s" if len(guided) > 1 else ""} {", ".join(i for i, _ in guided)}'
            if len(stages) > len(guided) else '')
    elif kinds:  # each kind of guidance with its stages
        start += ', guided by a teacher (' + '; '.join(
            f'{kind} in stage{"s" if sum(k == kind for _, k in guided) > 1 else ""} '
            f'{", ".join(i for i, k in guided if k == kind)}' for kind in kinds) + ')'
    return {
        'tags': ['image-classification', 'timm', 'timm_odevit'],
        'license': 'apache-2.0',
        'description': record['description'] or (
            f'`{arch}` trained {start}'
            + f' on {DATASET} (28x28 grey clothing images, 10 classes, resized to {size[-1]} px) on a CPU; the '
            'training recipe and the measured top-1 are below.'),
        'details': details,
        'usage': usage,
    }
