"""Export a trained checkpoint into ``weights/<arch>.<tag>/`` exactly as its Hub repository, and push one.

The folder holds ``model.safetensors`` and ``config.json`` as ``timm.models.save_for_hf`` writes them, the weight's
``record.json`` and a model card ``README.md`` rendered from that record by timm's ``generate_readme``, with the
measured top-1 as its model-index (``record.py``); ``weights/MANIFEST.json`` is rewritten with every file's sha256
and size, and the repo is verified (config, architecture, weight shapes) before the command returns.
"""
import copy
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

import timm
from timm.models import save_for_hf

from . import CARD_FILE, CONFIG_FILE, ORG, WEIGHTS_FILE
from .. import data as fm
from ..evaluate import evaluate, evaluate_solved, parse_solver, solver_kwargs
from ..files import write_failed
from timm_odevit.layers import DISCRETISATION_OPTIONS, ode_trunk
from timm_odevit.models.pretrained import fmnist_input
from ..train import PROG, checkpoint_args, is_training_command, model_from_checkpoint, read_checkpoint, recorded_args
from .card import evaluate_command, model_card
from .record import (RECORD_FILE, eval_results, read_record, read_results, record_json, render_card, stage_record,
                     weight_record)
from .revisions import check_replaceable, source_line, weights_source
from .verify import EXPORT_FIX, RepoError, sha256_file, verify_repo, write_manifest

__all__ = ['TEST_SETS', 'STORAGE_DTYPES', 'TRAINED_SOLVER_KWARGS', 'solver_table', 'measure', 'trained_solver',
           'architecture_solver', 'stored_dtype', 'run_stages', 'export_checkpoint', 'export',
           'remeasure', 'push']

# where the card's two top-1 figures are measured: (card name, IDX folder, --data of `hub evaluate`)
TEST_SETS = (('Fashion-MNIST sample (1,000 test images, bundled)', fm.SAMPLE_DIR, 'sample'),
             ('Fashion-MNIST test set (10,000 images)', fm.DEBIAN_FASHION_MNIST, 'full'))
# what a weights file may store its tensors in: half precision halves a file (the repository's working tree, weights
# included, must fit the 64 MiB a GPU run carries); timm's loader copies any of them into a float32 model
STORAGE_DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}
# the --model-kwargs that set a trunk's depth and an ODE trunk's discretisation (adjoint and max_nfe only change how
# it trains or fails); a weight-shared trunk's depth (loops, the ODE's output points and t_end) shows in no tensor shape
TRAINED_SOLVER_KWARGS = ('depth', 'ode_t_end') + tuple(f'ode_{name}' for name in DISCRETISATION_OPTIONS)


def solver_table(steps: int) -> List[str]:
    """The solvers of a card's top-1 against the solver, for a field trained on ``steps`` Euler steps: each explicit
    method at a quarter, half and once that grid's NFE (Euler also at twice it), and dopri5 with the NFE it takes."""
    table = [f'{method}:{max(1, round(share * steps / evals))}' for method, evals, shares in
             (('euler', 1, (.25, .5, 1, 2)), ('midpoint', 2, (.25, .5, 1)), ('rk4', 4, (.25, .5, 1)))
             for share in shares]
    return list(dict.fromkeys(table)) + ['dopri5']


def measure(model: nn.Module, folder: str, full_test: bool = True,
            other_solver: Optional[Dict[str, Any]] = None, solvers: bool = False) -> Dict[str, Dict[str, Any]]:
    """The card's top-1 figures for weights to be exported to ``folder``, at the solver the model has (what
    ``pretrained=True`` gives): on the bundled sample and (when ``full_test`` and Debian's package is installed) the
    full test set, each with the command that measures it; an ODE model is measured at ``other_solver`` too (keyword
    arguments of ``set_solver``: the architecture's default where the weights were trained on another grid) and, with
    ``solvers``, on the sample at each solver of ``solver_table`` (the trade of accuracy against NFE)."""
    sets = [t for t in TEST_SETS if t[2] == 'sample' or (full_test and t[1].is_dir())]
    metrics, other = {}, {}
    for name, src, key in sets:
        images = fm.load_tensors(src, 'test', model=model)
        if key == 'sample':
            sample = name, key, images  # the solver table's images, loaded once
        r = evaluate_solved(model, images, other_solver)
        metrics[name] = dict(r['registered'], dataset=name, data=key, command=evaluate_command(folder, key))
        if 'solver' in r:
            method, steps = r['solver']['solver'].split(':')
            other[f"{name}, at the architecture's default solver ({method}, {steps} steps)"] = dict(
                r['solver'], dataset=name, data=key, command=evaluate_command(folder, key, r['solver']['solver']))
    trunk = ode_trunk(model)
    if solvers and trunk is not None:
        name, key, images = sample
        done = {m['solver'] for m in (*metrics.values(), *other.values()) if m['data'] == key}
        for text in (t for t in solver_table(trunk.steps) if t not in done):
            method, steps = parse_solver(text)
            with trunk.solver(**solver_kwargs(method, steps)):
                r = evaluate(model, images)
            how = f'{steps} step{"s" * (steps > 1)}' if steps else 'adaptive'
            other[f'{name}, solved with {method} ({how}, NFE {r["nfe"]:.4g})'] = dict(
                r, solver=text, dataset=name, data=key, command=evaluate_command(folder, key, text))
    return {**metrics, **other}


def trained_solver(model_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The depth and ODE solver options among a run's ``--model-kwargs``: the weights learnt that discretisation,
    so the export keeps them (config.json's ``model_args``, what ``pretrained=True`` solves with)."""
    return {k: v for k, v in (model_kwargs or {}).items() if k in TRAINED_SOLVER_KWARGS}


def architecture_solver(arch: str, model: nn.Module) -> Optional[Dict[str, Any]]:
    """``set_solver`` options of ``arch``'s registered default when ``model`` (an ODE model) is solved otherwise;
    None for a discrete model or one at its architecture's default."""
    trunk = ode_trunk(model)
    if trunk is None:
        return None
    default = ode_trunk(timm.create_model(arch, device='meta')).solver_options()
    default = {k: default[k] for k in DISCRETISATION_OPTIONS}
    return None if all(trunk.solver_options()[k] == v for k, v in default.items()) else default


def stored_dtype(path: Path) -> torch.dtype:
    """The floating-point dtype a weights file stores its tensors in, from the header alone (RepoError when the file
    is not complete safetensors or mixes floating dtypes)."""
    names = {'F32': torch.float32, 'F16': torch.float16, 'BF16': torch.bfloat16, 'F64': torch.float64}
    try:
        with safe_open(str(path), framework='pt') as f:
            found = {names[d] for d in (f.get_slice(k).get_dtype() for k in f.keys()) if d in names}
    except (SafetensorError, OSError, ValueError) as e:
        raise RepoError(path, f'not a complete safetensors file ({e}); restore it or re-export with '
                              f'`{EXPORT_FIX}`.') from e
    if len(found) > 1:
        raise RepoError(path, f'mixes floating dtypes {sorted(str(d) for d in found)}; re-export it with '
                              f'`{EXPORT_FIX}` (and --dtype for one storage precision).')
    return found.pop() if found else torch.float32


def run_stages(args: Dict[str, Any], record: Dict[str, Any], cfg: Dict[str, Any], repo: Path,
               threads: Optional[int] = None, ema_published: bool = True) -> List[Dict[str, Any]]:
    """The stages (``hub.record.stage_record``) of a run of the training command (its options and its
    ``results.json`` record), preceded by those of every stage before it when it started from earlier weights
    (``--initial-checkpoint``); ``repo``: the folder the export writes. The weights the run loaded (its start, its
    teacher) are named by repo and revision where they are a committed published folder (``revisions.py``)."""
    before, source = [], None
    if args.get('initial_checkpoint'):
        before, source = _stages_before(args['initial_checkpoint'], record.get('initial_checkpoint_sha256'), cfg, repo)
    teacher = weights_source(args['teacher_checkpoint'], record.get('teacher_checkpoint_sha256')) \
        if args.get('teacher') and args.get('teacher_checkpoint') else None
    return before + [stage_record(args, cfg, threads, record.get('history'), record.get('guidance'), ema_published,
                                  record.get('device_name'), source, teacher)]


def _stages_before(path: str, recorded_sha256: Optional[str], cfg: Dict[str, Any],
                   repo: Path) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The stages that made the weights a run started from, and those weights as a stage's ``initialised_from``
    (``revisions.weights_source``, and the card line naming them): a published folder's record, or a checkpoint of
    the training command with its own stages; none for weights whose recipe is not known."""
    source = weights_source(path, recorded_sha256)
    src, line = Path(path), source_line(source)
    if src.name == WEIGHTS_FILE and (src.parent / RECORD_FILE).is_file():
        stages = read_record(src.parent)['stages']
        if not source.get('revision'):
            line += f', the published `{src.parent.name}` weights (uncommitted: no revision holds them)'
        if src.parent.resolve() == repo.resolve():
            line += ', which this export replaces' + (' (still loadable at that revision)' if source.get('revision')
                                                      else '')
    else:
        try:
            args = checkpoint_args(read_checkpoint(str(src)))
        except pickle.UnpicklingError:  # safetensors, or a pickle of more than tensors: no command recorded
            args = {}
        stages = []
        if args.get('trainer') == PROG:
            results = src.parent / 'results.json'
            stages = run_stages(args, json.loads(results.read_text()) if results.is_file() else {}, cfg, repo)
            line += f', the last checkpoint of stage {len(stages)}'
    if not stages:
        line += ('; weights of unknown provenance: their recipe is not stated here and the images seen count '
                 'only the stages below')
    return stages, {**source, 'line': line}


def export_checkpoint(
        checkpoint: str,
        tag: str,
        root: str = 'weights',
        pretrained_cfg: Optional[Dict[str, Any]] = None,
        description: Optional[str] = None,
        full_test: bool = True,
        use_ema: bool = False,
        arch: Optional[str] = None,
        threads: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
        solvers: bool = False,
) -> Dict[str, Any]:
    """Export a checkpoint of ``python -m timm_odevit_tools.train`` (or timm's train.py) to ``root/<arch>.<tag>/``: the
    registered architecture with ``pretrained_cfg`` (default: Fashion-MNIST at the size the run trained at, its
    ``--model-kwargs img_size``, else 32 px), a card rendering the run's command and budget (for this package's
    command only; ``threads`` for a run that did not record its own), and top-1 measured here, on the weights as
    stored in ``dtype``. An ODE model keeps the solver options it was trained with (``trained_solver``); ``solvers``
    adds its top-1 against the solver (``measure``). Returns the folder and the top-1 figures."""
    ckpt = read_checkpoint(checkpoint)
    args = checkpoint_args(ckpt)
    cfg = dict(pretrained_cfg or ckpt.get('pretrained_cfg')
               or fmnist_input((args.get('model_kwargs') or {}).get('img_size')))
    model = model_from_checkpoint(checkpoint, arch, use_ema, cfg, **trained_solver(args.get('model_kwargs')))
    if dtype != torch.float32:
        # the card's figures are those of the file a user loads: its values rounded to dtype, in a float32 model
        model.load_state_dict({k: v.to(dtype).to(v.dtype) if v.is_floating_point() else v
                               for k, v in model.state_dict().items()})
    arch = arch or args.get('model') or ckpt['arch']
    check_replaceable(Path(root) / f'{arch}.{tag}')  # before measuring: the weights it would replace are kept
    stages = []
    if args.get('trainer') == PROG:
        # the run's record beside its checkpoint gives the card its wall time and a guided run's resolved guidance;
        # read before measuring, so that missing or changed earlier weights fail at once
        results = Path(checkpoint).parent / 'results.json'
        run = json.loads(results.read_text()) if results.is_file() else {}
        stages = run_stages(args, run, cfg, Path(root) / f'{arch}.{tag}', threads, use_ema)
    other = architecture_solver(arch, model)
    metrics = measure(model, f'{root}/{arch}.{tag}', full_test, other, solvers)
    record = weight_record(f'{arch}.{tag}', model, stages, description, dtype, _solver_name(other))
    repo = export(model, arch, tag, root, record, metrics, dtype)
    return {'repo': str(repo), **{k: v['top1'] for k, v in metrics.items()}}


def _solver_name(options: Optional[Dict[str, Any]]) -> Optional[str]:
    return f'{options["method"]}:{options["steps"]}' if options else None


def remeasure(folder: str, full_test: bool = True, solvers: Optional[bool] = None) -> Dict[str, Any]:
    """Re-measure a published folder and re-render its card, record and ``config.json``, the weights untouched: at
    the ODE solver its last training stage ran (its record's command), with the stages and description its record
    states, and with ``solvers`` its top-1 against the solver (``measure``; None: where the card has that table). For
    weights exported before the export kept that solver, or after a change to how the model is built. Returns the
    folder and the top-1 figures."""
    repo = Path(folder)
    before = read_record(repo)
    if solvers is None:  # a re-render keeps what the card showed
        try:  # without the table a card has the sample at two solvers at most: the registered and the default
            solvers = len({r.metric_config for r in read_results(repo) if r.dataset_config == 'sample'}) > 2
        except ValueError:
            solvers = False  # a card without its model-index (rewritten by hand) shows no table to keep
    if not before['stages']:
        raise ValueError(f'{repo / RECORD_FILE} states no recipe to keep; re-export the checkpoint with '
                         f'`{EXPORT_FIX}`.')
    arch, _, tag = repo.name.partition('.')
    command = before['stages'][-1]['command']
    solver = trained_solver(recorded_args(command).model_kwargs) if is_training_command(command) else {}
    dtype = stored_dtype(repo / WEIGHTS_FILE)
    model = timm.create_model(f'local-dir:{repo.resolve()}', pretrained=True, **solver).eval()
    other = architecture_solver(arch, model)
    metrics = measure(model, str(repo), full_test, other, solvers)
    record = weight_record(repo.name, model, before['stages'], before['description'], dtype, _solver_name(other))
    export(model, arch, tag, str(repo.parent), record, metrics, dtype)
    return {'repo': str(repo), **{k: v['top1'] for k, v in metrics.items()}}


def export(
        model: nn.Module,
        arch: str,
        tag: str,
        root: str = 'weights',
        record: Optional[Dict[str, Any]] = None,
        metrics: Optional[Dict[str, Dict[str, Any]]] = None,
        dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``root/<arch>.<tag>/`` (safetensors with its tensors in ``dtype``, config.json, record.json and the
    card README.md rendered from the record and the measured ``metrics``), update the manifest and verify it."""
    repo = Path(root) / f'{arch}.{tag}'
    Path(root).mkdir(parents=True, exist_ok=True)
    # written beside, then each file renamed into place: a reader (the mirror, a client) never sees half a file, and
    # a failed write (a full disk) leaves the folder as it was
    staging = Path(tempfile.mkdtemp(prefix=f'.{repo.name}.', dir=root))
    try:
        save_for_hf(copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model, str(staging),
                    safe_serialization=True)
        record = record or weight_record(f'{arch}.{tag}', model, [], dtype=dtype)
        metrics = metrics or {}
        (staging / RECORD_FILE).write_text(record_json(record), encoding='utf-8')
        (staging / CARD_FILE).write_text(render_card(model_card(record, metrics), f'{arch}.{tag}',
                                                     eval_results(metrics)), encoding='utf-8')
        repo.mkdir(exist_ok=True)
        for f in sorted(staging.iterdir()):
            os.replace(f, repo / f.name)
    except (OSError, RuntimeError, SafetensorError) as e:
        raise write_failed(f'Exporting {repo.name}', root, e, f'Nothing in {root} was changed: export again once '
                           'the cause is fixed.') from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_manifest(Path(root))
    errors = verify_repo(Path(root), repo.name)
    if errors:
        raise errors[0]
    return repo


def push(folder: str, repo_id: Optional[str] = None, dry_run: bool = False, token: Optional[str] = None,
         private: bool = False) -> List[str]:
    """Push ``weights/<arch>.<tag>/`` with timm's ``push_to_hf_hub``, then the folder's own record and model card.

    The model is rebuilt from the folder (``local-dir:``) so that timm re-serialises exactly what is there; the dry
    run does that serialisation into a temporary folder and reports each file, its size and whether it is
    byte-identical to the folder's, without touching the network.
    """
    folder_p = Path(folder)
    repo_id = repo_id or f'{ORG}/{folder_p.name}'
    # timm loads any stored precision into float32; it is sent back in the precision the folder stores
    model = timm.create_model(f'local-dir:{folder_p.resolve()}', pretrained=True).to(
        stored_dtype(folder_p / WEIGHTS_FILE))
    lines = [f'repo: {repo_id} (private={private})']
    if dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            save_for_hf(model, tmp, safe_serialization=True)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                sent = Path(tmp) / name
                mine = folder_p / name
                if not mine.is_file():
                    same = 'not in'
                elif sha256_file(sent) == sha256_file(mine):
                    same = 'byte-identical to'
                elif name == CONFIG_FILE and json.loads(sent.read_text()) == json.loads(mine.read_text()):
                    same = 'same JSON (key order aside) as'  # timm's dict order after a local-dir round trip
                else:
                    same = 'DIFFERS from'
                lines.append(f'  {name:18s} {sent.stat().st_size:>10d} bytes  sha256 {sha256_file(sent)[:16]}  '
                             f'{same} {mine}')
        for name, what in ((RECORD_FILE, 'uploaded after'),
                           (CARD_FILE, 'uploaded after, replacing any generated card')):
            lines.append(f'  {name:18s} {(folder_p / name).stat().st_size:>10d} bytes  ({what})')
        lines.append('dry run: nothing sent')
        return lines
    from huggingface_hub import HfApi
    from timm.models import push_to_hf_hub
    push_to_hf_hub(model, repo_id, token=token, private=private, safe_serialization=True,
                   commit_message=f'Add {folder_p.name} weights (timm_odevit)')
    for name, message in ((RECORD_FILE, 'Training record'), (CARD_FILE, 'Model card')):
        HfApi(token=token).upload_file(path_or_fileobj=str(folder_p / name), path_in_repo=name, repo_id=repo_id,
                                       commit_message=message)
    lines.append('pushed')
    return lines
