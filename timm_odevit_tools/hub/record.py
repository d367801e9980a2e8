"""A published weight's facts as data, so that nothing reads a model card's Markdown back.

- ``record.json`` beside ``config.json``: what the weights are (params, GMACs, input, stored precision, the solver
  ``pretrained=True`` gives and the architecture's default where they differ) and what trained them, stage by stage
  in training order (each stage's command, training images, epochs, minutes, the weights it started from, its
  teacher, and the card lines it renders to).
- The card's ``model-index`` metadata: the measured top-1 figures as huggingface_hub's ``EvalResult``, as the Hub
  shows them.

The export writes both, the card and the README's tables are rendered from them.
"""
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from huggingface_hub import EvalResult, ModelCard
from torch import nn

from timm_odevit.layers import ode_trunk
from . import CARD_FILE, RECORD_FILE
from ..data import FASHION_MNIST_TRAIN_IMAGES
from .card import images_per_epoch, training_lines, training_minutes
from .verify import EXPORT_FIX

__all__ = ['RECORD_FILE', 'RECORD_FORMAT', 'stage_record', 'weight_record', 'read_record', 'record_json',
           'eval_results', 'read_results', 'render_card', 'top1']

RECORD_FORMAT = 1
TASK = 'image-classification'
DATASET_TYPE = 'fashion_mnist'
# a result's metric_config for a model that has no solver to name
DISCRETE = 'discrete'


def stage_record(args: Dict[str, Any], cfg: Dict[str, Any], threads: Optional[int] = None,
                 history: Optional[List[Dict[str, Any]]] = None, guidance: Optional[Dict[str, Any]] = None,
                 ema_published: bool = True, device_name: Optional[str] = None,
                 initialised_from: Optional[Dict[str, Any]] = None,
                 teacher_from: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One run of the training command as a stage of a record: its options as a dict (``args``), ``cfg`` the
    exported input config, the rest as ``hub.card.training_lines`` takes them; ``initialised_from``: the weights it
    started from, when it did, and ``teacher_from``: its teacher's weights file, each as ``revisions.weights_source``
    names weights (a published repo and revision, else a sha256; ``initialised_from`` with its card ``line``)."""
    lines = training_lines(args, cfg, threads, history, guidance, ema_published, device_name, teacher_from)
    if initialised_from:
        lines = {'initialised from': initialised_from['line'], **lines}
        initialised_from = {k: v for k, v in initialised_from.items() if k != 'line'}
    teacher = None
    if args.get('teacher'):
        times = (guidance or {}).get('times')
        teacher = {'model': args['teacher'], **(teacher_from or {'weights': None}),
                   'distill': args.get('distill') or 'trajectory',
                   # as the card line writes them (6 significant digits)
                   'times': [float(f'{t:g}') for t in times] if times else None}
    return {'command': lines['command'].strip('`'),
            'train_images': args.get('train_samples') or FASHION_MNIST_TRAIN_IMAGES,
            'images_per_epoch': images_per_epoch(args), 'epochs': args['epochs'],
            'minutes': None if (m := training_minutes(args, history)) is None else round(m, 1),
            'initialised_from': initialised_from, 'teacher': teacher, 'lines': lines}


def weight_record(name: str, model: nn.Module, stages: List[Dict[str, Any]], description: Optional[str] = None,
                  dtype: torch.dtype = torch.float32, default_solver: Optional[str] = None) -> Dict[str, Any]:
    """A published weight's record: ``name`` (``<arch>.<tag>``), what ``model`` is (params, GMACs, input, the
    solver ``pretrained=True`` gives), ``stages`` (``stage_record`` each, training order; empty for weights of
    unknown provenance), the card's ``description`` (None: rendered from the stages), the stored ``dtype``, and
    ``default_solver`` ('euler:12'), the architecture's where the weights were trained on another grid."""
    from ..benchmark.runner import count_gmacs
    size = tuple(model.pretrained_cfg['input_size'])
    trunk = ode_trunk(model)
    return {'format': RECORD_FORMAT, 'weights': name, 'architecture': name.partition('.')[0],
            'params': sum(p.numel() for p in model.parameters()),
            'gmacs': round(count_gmacs(model, size[-1]), 4), 'input_size': list(size),
            'stored_dtype': str(dtype).replace('torch.', ''),
            'solver': f'{trunk.method}:{trunk.steps}' if trunk is not None else None,
            'default_solver': default_solver, 'description': description, 'stages': stages}


def _remedy(repo: Path) -> str:
    return (f're-render it from its weights and recipe with `python -m timm_odevit_tools.hub remeasure {repo}`, or '
            f're-export the run with `{EXPORT_FIX}`')


def read_record(repo: Path) -> Dict[str, Any]:
    """The ``record.json`` of a published folder (ValueError naming the file and the fix when it is missing, not
    JSON, or of another format)."""
    path = Path(repo) / RECORD_FILE
    try:
        record = json.loads(path.read_text(encoding='utf-8'))
    except FileNotFoundError:
        raise ValueError(f'{path} is missing: a published folder states its facts there; {_remedy(repo)}.') from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f'{path} is not JSON ({e}); restore it (git checkout), or {_remedy(repo)}.') from e
    if not isinstance(record, dict) or record.get('format') != RECORD_FORMAT:
        raise ValueError(f'{path} is not a record of format {RECORD_FORMAT}; {_remedy(repo)}.')
    return record


def record_json(record: Dict[str, Any]) -> str:
    return json.dumps(record, indent=2) + '\n'


def eval_results(metrics: Dict[str, Dict[str, Any]]) -> List[EvalResult]:
    """The card's measured figures (``hub.export.measure``: name -> top1, data, solver, ...) as model-index results:
    one per test set and solver, the test set as the dataset's config (``sample`` or ``full``, the ``--data`` of
    ``hub evaluate``; the Hub groups results by it) and its name as the card names it, the solver as the metric's
    config."""
    return [EvalResult(task_type=TASK, dataset_type=DATASET_TYPE, dataset_name=m['dataset'], dataset_config=m['data'],
                       dataset_split='test', metric_type='accuracy', metric_name='top-1',
                       metric_value=round(m['top1'], 2), metric_config=m.get('solver') or DISCRETE)
            for m in metrics.values()]


def read_results(repo: Path) -> List[EvalResult]:
    """The model-index results of a published folder's card (ValueError naming the card and the fix when it has
    none)."""
    path = Path(repo) / CARD_FILE
    try:
        results = ModelCard.load(path).data.eval_results
    except (OSError, ValueError) as e:
        raise ValueError(f'{path} cannot be read ({e}); {_remedy(repo)}.') from e
    if not results:
        raise ValueError(f'{path} has no model-index results; {_remedy(repo)}.')
    return results


def top1(results: List[EvalResult], data: str, solver: Optional[str]) -> Optional[float]:
    """The top-1 of ``results`` on the test set ``data`` ('sample' or 'full') solved by ``solver`` ('euler:12', or
    None for a discrete model); None where it was not measured."""
    want = solver or DISCRETE
    found = [r.metric_value for r in results if r.dataset_config == data and (r.metric_config or DISCRETE) == want]
    return float(found[0]) if found else None


def render_card(card: Dict[str, Any], name: str, results: List[EvalResult]) -> str:
    """The card Markdown: timm's ``generate_readme`` body, its metadata with the model-index ``results`` added."""
    from timm.models._hub import generate_readme
    rendered = ModelCard(generate_readme(card, name))
    rendered.data.model_name = name
    rendered.data.eval_results = results
    return str(rendered)
