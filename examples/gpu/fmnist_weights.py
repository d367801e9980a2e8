"""Train the published tiny Fashion-MNIST weights in one go on one GPU, through the one training command.

    PYTHONPATH=. python examples/gpu/fmnist_weights.py OUT_DIR --data-dir DIR --budget-s 380 --deadline-s 500

Every run (``RUNS``: the six tiny 32 px families trained alone, and the two ODE students guided by the published
``ssog_vit_tiny_patch4_32.fmnist``) shares one recipe exactly (``RECIPE``: seed, epochs, batch, schedule,
augmentation, EMA), so each SSoG model and its dense twin, and each guided student and the same model trained
alone, are matched pairs. The data lives on the GPU (``--data-on-device``), to rule out per-image loading as what
held the first attempt to 1,000-3,000 images/s a run (it was not: see below). All runs share the GPU at once.
The epochs are set by the budget: a calibration pass times a few steps of every run side by side; the epochs are
what the harmonic mean of those rates fits in ``--budget-s`` (the GPU's work, shared in turn), never fewer than the
slowest run fits. A run still going at
``--deadline-s`` is stopped and keeps its last finished epoch. Each run's folder (command, log, per-epoch validation
in results.json) and a model-only checkpoint (the weights and their EMA of the last epoch, float16, no optimizer
state) go to OUT_DIR, packed as one gzipped tar split in parts of at most 15 MiB.

Run on an H200 on 2026-12-04 (``--budget-s 400 --deadline-s 515``): 9 epochs fitted, 84-86% top-1, below the
published weights, so nothing was published; eight runs sharing the GPU were no faster than one after another, and
SSoG trains 4x slower than its dense twin there (benchmarks/gpu_h200/README.md). Since then: ``--compile`` compiles
every run (CUDA graphs against SSoG's launch-bound small kernels), the EMA decay follows the run's length (its horizon
a tenth of the run's steps, ``ema_decay``: 0.998 trailed a 1,000-step run by 10-20 points), and ``--only`` with a
high ``--max-epochs`` gives one run the whole GPU: the long dense teacher of issue 16, the next call's plan
(docs/experiments.md, "What the remaining targets need"):

    PYTHONPATH=. python examples/gpu/fmnist_weights.py OUT_DIR --data-dir gpu_data/fashion-mnist \
        --only dense_vit_tiny_patch4_32.fmnist --max-epochs 120 --budget-s 400 --deadline-s 540
"""
import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

RECIPE = ['--in-chans', '1', '--num-classes', '10', '--batch-size', '512', '--opt', 'adamw', '--lr', '1e-3',
          '--weight-decay', '0.05', '--warmup-epochs', '2', '--min-lr', '1e-5', '--clip-grad', '1.0', '--augment',
          '--smoothing', '0.1', '--model-ema', '--amp', 'bf16', '--data-on-device',
          '--val-samples', '2000', '--seed', '0', '--workers', '2', '--log-interval', '50', '--checkpoint-hist', '1']
TEACHER = ['--teacher', 'ssog_vit_tiny_patch4_32', '--teacher-checkpoint',
           'weights/ssog_vit_tiny_patch4_32.fmnist/model.safetensors', '--teacher-kwargs', 'in_chans=1']
# run name (the published weight it makes) -> model and what it adds to the recipe
RUNS: Dict[str, Tuple[str, List[str]]] = {
    'dense_vit_tiny_patch4_32.fmnist': ('dense_vit_tiny_patch4_32', []),
    'ssog_vit_tiny_patch4_32.fmnist': ('ssog_vit_tiny_patch4_32', []),
    'looped_vit_tiny_patch4_32.fmnist': ('looped_vit_tiny_patch4_32', []),
    'looped_ssog_tiny_patch4_32.fmnist': ('looped_ssog_tiny_patch4_32', []),
    'odevit_tiny_patch4_32.fmnist': ('odevit_tiny_patch4_32', []),
    'ssog_ode_tiny_patch4_32.fmnist': ('ssog_ode_tiny_patch4_32', []),
    'odevit_tiny_patch4_32.fmnist_distilled': ('odevit_tiny_patch4_32', TEACHER),
    'ssog_ode_tiny_patch4_32.fmnist_distilled': ('ssog_ode_tiny_patch4_32', TEACHER),
}
TRAIN_IMAGES = 60000
BATCH_SIZE = int(RECIPE[RECIPE.index('--batch-size') + 1])


def ema_decay(steps: int) -> float:
    """The EMA decay whose horizon (1 / (1 - decay) steps) is a tenth of a run of ``steps`` optimizer steps, within
    [0.99, 0.9999]: a fixed 0.998 (500 steps) is half of a 1,000-step run and left its EMA 10-20 points behind."""
    return round(min(0.9999, max(0.99, 1. - 10. / max(steps, 1))), 5)


def command(run: str, out: Path, data_dir: str, device: str, extra: List[str]) -> List[str]:
    model, adds = RUNS[run]
    return [sys.executable, '-m', 'timm_odevit_tools.train', '--model', model, *RECIPE, *adds, '--data-dir', data_dir,
            '--device', device, '--output', str(out), '--experiment', run, *extra]


def run_all(out: Path, data_dir: str, device: str, extra: Dict[str, List[str]], deadline: float) -> Dict[str, int]:
    """Start every run of ``extra`` at once; wait for all, stopping those still going at ``deadline`` (a
    ``time.time()``); their exit codes (a stopped run's is negative)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS='2')  # 8 runs on 16 cores
    procs = {}
    for run in extra:
        log = open(out / f'{run}.stdout', 'w')
        procs[run] = subprocess.Popen(command(run, out, data_dir, device, extra[run]), stdout=log,
                                      stderr=subprocess.STDOUT, env=env)
    codes = {}
    while len(codes) < len(procs):
        for run, p in procs.items():
            if run not in codes and p.poll() is not None:
                codes[run] = p.returncode
        if time.time() > deadline:
            for run, p in procs.items():
                if run not in codes:
                    p.kill()
                    codes[run] = p.wait()
        time.sleep(1)
    return codes


def warmup_within(epochs: int) -> List[str]:
    """The recipe's warm-up, shortened to fit a run of ``epochs`` (the training command refuses a warm-up as long as
    the run); nothing to add when it fits."""
    warmup = int(RECIPE[RECIPE.index('--warmup-epochs') + 1])
    return [] if warmup < epochs else ['--warmup-epochs', str(epochs - 1)]


def calibrate(out: Path, data_dir: str, device: str, runs: List[str], steps: int, light: List[str],
              deadline: float) -> Dict[str, float]:
    """Images/s of each run while all of them share the device (steps of the real recipe, warm-up included; with
    ``--torchcompile`` the rate of a second short epoch, as the first one's includes compiling)."""
    # the steps' images alone: every run decodes its training images onto the device first
    epochs = '2' if '--torchcompile' in light else '1'
    extra = ['--epochs', epochs, '--max-steps-per-epoch', str(steps), '--train-samples', str(steps * BATCH_SIZE),
             '--val-samples', '512'] + warmup_within(int(epochs)) + light
    codes = run_all(out, data_dir, device, {r: extra for r in runs}, deadline)
    rates = {}
    for run, code in codes.items():
        if code != 0:
            sys.stdout.write((out / f'{run}.stdout').read_text()[-3000:])
            raise SystemExit(f'calibration of {run} failed with exit code {code}')
        results = json.loads((out / run / 'results.json').read_text())
        rates[run] = results['history'][-1]['images_per_second']
    return rates


def strip_checkpoint(src: Path, dst: Path) -> None:
    """The last epoch's weights and EMA in float16 with the run's arguments, without optimizer state: what a GPU call
    can bring back (export measures and stores float16 anyway)."""
    import torch
    from timm_odevit_tools.train import read_checkpoint
    ckpt = read_checkpoint(str(src))
    kept = {k: v for k, v in ckpt.items() if k in ('arch', 'args', 'epoch', 'metric')}
    for key in ('state_dict', 'state_dict_ema'):
        if key in ckpt:
            kept[key] = {k: v.half() if v.is_floating_point() else v for k, v in ckpt[key].items()}
    torch.save(kept, dst)


def pack(runs: Path, names: List[str], out: Path, part_bytes: int = 15 << 20) -> None:
    with tarfile.open(out / 'weights_runs.tgz', 'w:gz') as tar:
        for run in names:
            folder = runs / run
            if not folder.is_dir():
                continue
            for f in sorted(folder.iterdir()):
                if not f.name.endswith('.pth.tar'):
                    tar.add(f, arcname=f'{run}/{f.name}')
            if (runs / f'{run}.pth').exists():
                tar.add(runs / f'{run}.pth', arcname=f'{run}/{run}.pth')
            tar.add(runs / f'{run}.stdout', arcname=f'{run}/stdout.txt')
    data = (out / 'weights_runs.tgz').read_bytes()
    (out / 'weights_runs.tgz').unlink()
    for i in range(math.ceil(len(data) / part_bytes)):
        (out / f'weights_runs.tgz.part{i}').write_bytes(data[i * part_bytes:(i + 1) * part_bytes])


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('out_dir')
    p.add_argument('--data-dir', required=True)
    p.add_argument('--device', default='cuda')
    p.add_argument('--budget-s', type=float, default=380., help='wall time the epochs are sized to')
    p.add_argument('--deadline-s', type=float, default=500., help='from the start: runs still going are stopped')
    p.add_argument('--calibration-steps', type=int, default=30)
    p.add_argument('--max-epochs', type=int, default=60)
    p.add_argument('--work-dir', default='/tmp/fmnist_weights')
    p.add_argument('--only', nargs='+', choices=list(RUNS), default=list(RUNS), help='these runs alone')
    p.add_argument('--compile', action='store_true', help='every run with --torchcompile')
    p.add_argument('--train-options', default='',
                   help="further options of every run's training command, e.g. '--train-split test' for a dry run "
                        'on the bundled test-split sample')
    p.add_argument('--dry-run', action='store_true', help='CPU-sized: a few steps on a subset, to check the path')
    args = p.parse_args(argv)
    out, work = Path(args.out_dir), Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    deadline = t0 + args.deadline_s
    # a dry run checks the path on a CPU: small batches, no loader workers, a few steps on a subset
    light = ['--batch-size', '16', '--workers', '0', '--train-samples', '256'] if args.dry_run else []
    light += (['--torchcompile'] if args.compile else []) + shlex.split(args.train_options)
    rates = calibrate(work / 'calibration', args.data_dir, args.device, args.only,
                      2 if args.dry_run else args.calibration_steps, light, deadline)
    print('calibration img/s (all runs at once):', {r: round(v) for r, v in rates.items()}, flush=True)
    harmonic = len(rates) / sum(1 / v for v in rates.values())
    budget = args.budget_s - (time.time() - t0)
    epochs = max(1, min(args.max_epochs, int(budget * max(harmonic, min(rates.values())) / TRAIN_IMAGES)))
    if args.dry_run:
        epochs = 1
    print(f'epochs: {epochs} (harmonic mean {harmonic:.0f} img/s, {budget:.0f} s of budget left, '
          f'calibration took {time.time() - t0:.0f} s)', flush=True)
    subset = ['--max-steps-per-epoch', '2', '--val-samples', '256'] + light if args.dry_run else light
    decay = ema_decay(epochs * math.ceil(TRAIN_IMAGES / BATCH_SIZE))
    print(f'EMA decay {decay} (a tenth of the run as its horizon)', flush=True)
    runs = work / 'runs'
    extra = {r: ['--epochs', str(epochs), '--model-ema-decay', str(decay)] + warmup_within(epochs) + subset
             for r in args.only}
    codes = run_all(runs, args.data_dir, args.device, extra, deadline)
    for run, code in codes.items():
        results = runs / run / 'results.json'
        top1 = json.loads(results.read_text())['top1'] if results.exists() else None
        print(f'{run}: exit {code}, epochs {epochs}, top1 {top1}', flush=True)
        if (runs / run / 'last.pth.tar').exists():
            strip_checkpoint(runs / run / 'last.pth.tar', runs / f'{run}.pth')
    print(f'training took {time.time() - t0:.0f} s in all', flush=True)
    out.mkdir(parents=True, exist_ok=True)
    pack(runs, args.only, out)


if __name__ == '__main__':
    main()
