"""Train every published Fashion-MNIST weight in one go on one GPU, through the one training command.

    PYTHONPATH=. python examples/gpu/fmnist_weights.py OUT_DIR --data-dir DIR --budget-s 330

One recipe per model size (``RECIPES``): the six tiny 32 px families share theirs exactly (seed, epochs, batch,
schedule, augmentation), so each SSoG model and its dense twin are a matched pair; ``ssog_ode_small`` trains at
112 px (patch 16, a 7 x 7 grid). All runs share the GPU at once. The epochs are set by the budget: a calibration
pass times a few steps of every run side by side, then the tiny runs get the epochs that their slowest member fits
in ``--budget-s`` at that rate (the small run likewise); the rate only rises as runs finish. Each run's folder
(command, log, per-epoch validation on the full test set in results.json) and a model-only checkpoint (the last
epoch's weights, no optimizer state) go to OUT_DIR, packed as one tar split in parts of at most 15 MiB.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Dict, List

TINY = ['--in-chans', '1', '--num-classes', '10', '--batch-size', '256', '--opt', 'adamw', '--lr', '1e-3',
        '--weight-decay', '0.05', '--warmup-epochs', '3', '--min-lr', '1e-5', '--clip-grad', '1.0', '--augment',
        '--amp', 'bf16', '--seed', '0', '--workers', '2', '--log-interval', '100', '--checkpoint-hist', '1']
RECIPES: Dict[str, List[str]] = {
    'tiny': TINY,
    'small': TINY + ['--model-kwargs', 'img_size=112'],
}
MODELS: Dict[str, str] = {
    'dense_vit_tiny_patch4_32': 'tiny',
    'ssog_vit_tiny_patch4_32': 'tiny',
    'looped_vit_tiny_patch4_32': 'tiny',
    'looped_ssog_tiny_patch4_32': 'tiny',
    'odevit_tiny_patch4_32': 'tiny',
    'ssog_ode_tiny_patch4_32': 'tiny',
    'ssog_ode_small': 'small',
}
TRAIN_IMAGES = 60000


def command(model: str, out: Path, data_dir: str, device: str, extra: List[str]) -> List[str]:
    return [sys.executable, '-m', 'timm_odevit.train', '--model', model, *RECIPES[MODELS[model]],
            '--data-dir', data_dir, '--device', device, '--output', str(out), '--experiment', model, *extra]


def run_all(out: Path, data_dir: str, device: str, extra: Dict[str, List[str]]) -> Dict[str, int]:
    """Start every run at once; wait for all; return exit codes."""
    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for model in MODELS:
        log = open(out / f'{model}.stdout', 'w')
        procs[model] = subprocess.Popen(command(model, out, data_dir, device, extra[model]),
                                        stdout=log, stderr=subprocess.STDOUT)
    return {m: p.wait() for m, p in procs.items()}


def calibrate(out: Path, data_dir: str, device: str, steps: int, light: List[str]) -> Dict[str, float]:
    """Images/s of each run while all of them share the device (steps of the real recipe, warm-up included)."""
    extra = ['--epochs', '1', '--max-steps-per-epoch', str(steps), '--val-samples', '512'] + light
    codes = run_all(out, data_dir, device, {m: extra for m in MODELS})
    rates = {}
    for model, code in codes.items():
        if code != 0:
            sys.stdout.write((out / f'{model}.stdout').read_text()[-3000:])
            raise SystemExit(f'calibration of {model} failed with exit code {code}')
        results = json.loads((out / model / 'results.json').read_text())
        rates[model] = results['history'][-1]['images_per_second']
    return rates


def strip_checkpoint(src: Path, dst: Path) -> None:
    """The last epoch's weights and the run's arguments, without optimizer state (which is twice the weights)."""
    import torch
    from timm_odevit.train import read_checkpoint
    ckpt = read_checkpoint(str(src))
    torch.save({k: v for k, v in ckpt.items() if k in ('arch', 'state_dict', 'args', 'epoch', 'metric')}, dst)


def pack(runs: Path, out: Path, part_bytes: int = 15 << 20) -> None:
    # gzip: float weights shrink a little, and every MiB counts against what one GPU call can bring back
    with tarfile.open(out / 'weights_runs.tgz', 'w:gz') as tar:
        for model in MODELS:
            run = runs / model
            for f in sorted(run.iterdir()):
                if not f.name.endswith('.pth.tar'):
                    tar.add(f, arcname=f'{model}/{f.name}')
            tar.add(runs / f'{model}.pth', arcname=f'{model}/{model}.pth')
            tar.add(runs / f'{model}.stdout', arcname=f'{model}/stdout.txt')
    data = (out / 'weights_runs.tgz').read_bytes()
    (out / 'weights_runs.tgz').unlink()
    for i in range(math.ceil(len(data) / part_bytes)):
        (out / f'weights_runs.tgz.part{i}').write_bytes(data[i * part_bytes:(i + 1) * part_bytes])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('out_dir')
    p.add_argument('--data-dir', required=True)
    p.add_argument('--device', default='cuda')
    p.add_argument('--budget-s', type=float, default=330., help='wall time for the real runs')
    p.add_argument('--calibration-steps', type=int, default=40)
    p.add_argument('--max-epochs', type=int, default=60)
    p.add_argument('--work-dir', default='/tmp/fmnist_weights')
    p.add_argument('--dry-run', action='store_true', help='CPU-sized: a few steps on a subset, to check the path')
    args = p.parse_args()
    out, work = Path(args.out_dir), Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    # a dry run checks the path on a CPU: small batches, no loader workers, a few steps on a subset
    light = ['--batch-size', '16', '--workers', '0'] if args.dry_run else []
    rates = calibrate(work / 'calibration', args.data_dir, args.device, 2 if args.dry_run else args.calibration_steps,
                      light)
    print('calibration img/s (all runs at once):', {m: round(r) for m, r in rates.items()}, flush=True)
    epochs = {}
    for size in RECIPES:
        slowest = min(r for m, r in rates.items() if MODELS[m] == size)
        epochs[size] = max(1, min(args.max_epochs, int(args.budget_s * slowest / TRAIN_IMAGES)))
    if args.dry_run:
        epochs = {size: 1 for size in RECIPES}
    print('epochs per recipe:', epochs, f'(calibration took {time.time() - t0:.0f} s)', flush=True)
    subset = ['--max-steps-per-epoch', '2', '--train-samples', '512', '--val-samples', '256'] + light if args.dry_run \
        else []
    runs = work / 'runs'
    codes = run_all(runs, args.data_dir, args.device,
                    {m: ['--epochs', str(epochs[MODELS[m]])] + subset for m in MODELS})
    for model, code in codes.items():
        results = runs / model / 'results.json'
        top1 = json.loads(results.read_text())['top1'] if results.exists() else None
        print(f'{model}: exit {code}, epochs {epochs[MODELS[model]]}, top1 {top1}', flush=True)
        if code == 0:
            strip_checkpoint(runs / model / 'last.pth.tar', runs / f'{model}.pth')
    print(f'training took {time.time() - t0:.0f} s in all', flush=True)
    out.mkdir(parents=True, exist_ok=True)
    pack(runs, out)


if __name__ == '__main__':
    main()
