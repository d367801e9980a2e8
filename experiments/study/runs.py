"""The matched Fashion-MNIST study: which runs exist, and a resumable runner that trains them one by one.

Every run is ``python -m timm_odevit_tools.train`` (timm's ClassificationTask, timm's optimizer, scheduler, checkpoint
saver and summary.csv), launched in its own process with a fixed thread count. Runs are
claimed through lock files, so several runners (one per core) can work through one study side by side, and a
killed runner's run resumes from its last epoch (``last.pth.tar``) the next time any runner reaches it.
"""
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from timm_odevit.models.families import SETTINGS, model_name

__all__ = ['RUN_OPTIONS', 'STUDY_PAIRS', 'StudyPair', 'StudyRecipe', 'Run', 'study_runs', 'run_dir', 'is_done',
           'train_command', 'run_study']

_logger = logging.getLogger(__name__)

# model kwargs the study gives both models of a setting: ODE-ViT's Base grid (24 points, Euler on [0, 12]); with
# 12 steps (h = 1) Euler would be the looped trunk
STUDY_KWARGS: Dict[str, Dict[str, Any]] = {'ode': {'ode_steps': 23}}


class StudyPair(NamedTuple):
    """The two models of one depth setting of the study, and the model kwargs both get."""
    dense: str
    ssog: str
    model_kwargs: Dict[str, Any]


# depth setting -> its pair; tiny width, patch 4 at 32 px
STUDY_PAIRS: Dict[str, StudyPair] = {
    depth: StudyPair(model_name(pair.dense, 'tiny', small_image=True), model_name(pair.ssog, 'tiny', small_image=True),
                     STUDY_KWARGS.get(depth, {}))
    for depth, pair in SETTINGS.items()
}


# options of the training command that train_command sets for every run (besides the recipe's fields)
RUN_OPTIONS = ('model', 'seed', 'output', 'experiment', 'log_interval', 'model_kwargs', 'data_dir', 'resume')


@dataclass(frozen=True)
class StudyRecipe:
    """One recipe for every run of the study (the CPU budget is set by train_samples x epochs)."""
    train_samples: int = 3000
    val_samples: int = 1000
    epochs: int = 3
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: int = 1
    min_lr: float = 1e-5
    clip_grad: float = 1.0
    in_chans: int = 1


@dataclass(frozen=True)
class Run:
    setting: str
    arch: str
    seed: int
    model_kwargs: Tuple[str, ...] = field(default=())
    arm: str = ''  # which arm of a comparison of one model (e.g. 'scratch' / 'guided'), part of the name
    extra_args: Tuple[str, ...] = field(default=())  # further options of the training command

    @property
    def name(self) -> str:
        return f'{self.arch}-{self.arm}-seed{self.seed}' if self.arm else f'{self.arch}-seed{self.seed}'

    @property
    def mixer(self) -> str:
        return 'ssog' if 'ssog' in self.arch else 'dense'


def study_runs(seeds: Sequence[int] = (0, 1), settings: Optional[Sequence[str]] = None) -> List[Run]:
    """Seed-major order, so a study cut short still has complete pairs for its first seeds."""
    names = list(settings or STUDY_PAIRS)
    unknown = [s for s in names if s not in STUDY_PAIRS]
    if unknown:
        raise ValueError(f'Unknown setting(s) {unknown}; choose from {list(STUDY_PAIRS)}.')
    return [Run(s, arch, seed, tuple(f'{k}={v}' for k, v in STUDY_PAIRS[s].model_kwargs.items()))
            for seed in seeds for s in names for arch in (STUDY_PAIRS[s].dense, STUDY_PAIRS[s].ssog)]


def run_dir(root: Path, run: Run) -> Path:
    return Path(root) / 'runs' / run.name


def is_done(root: Path, run: Run) -> bool:
    return (run_dir(root, run) / 'results.json').is_file()


def train_command(root: Path, run: Run, recipe: StudyRecipe, data_dir: Optional[str] = None) -> List[str]:
    """The command line of one run (what the README and the logs show); ``data_dir``: Fashion-MNIST IDX files
    (default: Debian's package)."""
    r = asdict(recipe)
    cmd = [sys.executable, '-m', 'timm_odevit_tools.train', '--model', run.arch, '--seed', str(run.seed),
           '--output', str(Path(root) / 'runs'), '--experiment', run.name, '--log-interval', '20']
    for key in ('train_samples', 'val_samples', 'epochs', 'batch_size', 'lr', 'weight_decay', 'warmup_epochs',
                'min_lr', 'clip_grad', 'in_chans'):
        cmd += [f'--{key.replace("_", "-")}', str(r[key])]
    cmd += list(run.extra_args)
    if run.model_kwargs:
        cmd += ['--model-kwargs', *run.model_kwargs]
    if data_dir:
        cmd += ['--data-dir', str(data_dir)]
    last = run_dir(root, run) / 'last.pth.tar'
    if last.is_file():
        cmd += ['--resume', str(last)]
    return cmd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(root: Path, run: Run) -> bool:
    """Take the run's lock file; a lock left by a dead process is taken over."""
    lock = Path(root) / 'runs' / f'{run.name}.lock'
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _pid_alive(pid):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, 'w') as f:
            f.write(str(os.getpid()))
        return True
    return False


def _release(root: Path, run: Run) -> None:
    (Path(root) / 'runs' / f'{run.name}.lock').unlink(missing_ok=True)


def run_study(
        root: Path,
        runs: Sequence[Run],
        recipe: StudyRecipe,
        threads: int = 1,
        data_dir: Optional[str] = None,
        setup: Optional[Dict[str, Any]] = None,
) -> Iterator[Tuple[Run, str]]:
    """Train every run not done yet and not claimed by another runner; yields (run, status): 'trained', 'already done',
    'skipped' (another runner has it) or 'failed'.

    The study's recipe (and ``setup``, what else its runs share, e.g. a teacher) is written to ``root/study.json``;
    a root made with another recipe or setup is refused, so runs of different budgets never end up in one table.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    meta = root / 'study.json'
    want: Dict[str, Any] = {'recipe': asdict(recipe), **({'setup': setup} if setup else {})}
    if meta.is_file():
        have = json.loads(meta.read_text())
        if have != want:
            diff = {k: (have.get(k), want.get(k)) for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k)}
            raise ValueError(f'{root} holds a study with other settings ({diff}: held, asked): use another --out-dir, '
                             'or the same options to resume it.')
    else:
        meta.write_text(json.dumps(want, indent=2) + '\n')
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    for run in runs:
        if is_done(root, run):
            yield run, 'already done'
            continue
        if not _claim(root, run):
            yield run, 'skipped'
            continue
        try:
            cmd = train_command(root, run, recipe, data_dir)
            run_dir(root, run).mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            _logger.info('%s: %s', run.name, ' '.join(cmd[1:]))
            # the command logs to train.log itself; its console (tracebacks included) goes to console.log
            with open(run_dir(root, run) / 'console.log', 'a') as log:
                rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            seconds = time.time() - t0
            if rc == 0 and is_done(root, run):
                with open(run_dir(root, run) / 'wall_seconds.txt', 'a') as f:
                    f.write(f'{seconds:.1f}\n')
                yield run, 'trained'
            else:
                _logger.error('%s failed (exit %d); see %s', run.name, rc, run_dir(root, run) / 'console.log')
                yield run, 'failed'
        finally:
            _release(root, run)
