"""The SSoG mixer's GPU check (issue 49) in one device call of at most 480 s, sections in this order, each written
to OUT_DIR/summary.md as soon as it finishes (a call cut short keeps what it measured):

1. versions;
2. CUDA against CPU outputs, float32 / bfloat16 / float16 autocast and float16 weights, every family;
3. a kernel profile of one SSoG and one fused-attention forward: CUDA kernels launched, GPU busy time, wall time;
4. timings of SSoG against fused SDPA and the identity floor (ODE, small, 224 and 1024 px, batch 1 and 32,
   inference and training step): eager, eager captured in CUDA graphs, and torch.compile 'reduce-overhead';
5. the mixing paths alone (Triton kernel, N x N operator, accumulate, einsum): agreement and time by grid size;
6. a training-step profile of the 32 px tiny pair at batch 512 (SSoG trained 4x slower than dense there).

    python benchmarks/gpu/mixer_check.py OUT_DIR             # on the GPU machine, from the checkout
    python benchmarks/gpu/mixer_check.py OUT_DIR --dry-run   # every section on the CPU at toy sizes (a test)
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import timm  # noqa: E402
import timm_odevit  # noqa: E402,F401  (registers the models)
from timm_odevit_tools.benchmark.runner import OpCounter  # noqa: E402
from timm_odevit.layers import SeparableGaussianMixer  # noqa: E402
from timm_odevit.layers.fused_mixer import HAS_TRITON  # noqa: E402
from timm_odevit.models.families import FAMILIES, model_name  # noqa: E402

TOTAL_SECONDS = 480


def _median_ms(fn: Callable[[], object], device: str, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        if device == 'cuda':
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == 'cuda':
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def versions(args) -> str:
    import torchdiffeq
    lines = [f'python {sys.version.split()[0]} | torch {torch.__version__} | timm {timm.__version__} | torchdiffeq '
             f'{torchdiffeq.__version__} | triton {"yes" if HAS_TRITON else "missing"}']
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f'gpu {torch.cuda.get_device_name(0)}, {p.total_memory / 2 ** 30:.0f} GiB, '
                     f'cuda {torch.version.cuda}')
    else:
        lines.append('gpu none: a CPU dry run')
    return '\n'.join(lines)


def precision(args) -> str:
    """Relative logit error against float32 on the CPU, same weights, 8 images."""
    rows = ['| model | float32 | bf16 autocast | fp16 autocast | fp16 weights |', '|---|---:|---:|---:|---:|']
    for family in ('ssog_ode', 'odevit') if args.dry_run else FAMILIES:
        torch.manual_seed(0)
        name = model_name(family, 'tiny', small_image=True)
        cpu = timm.create_model(name, num_classes=10).eval()
        x = torch.randn(8, 3, 32, 32)
        with torch.no_grad():
            ref = cpu(x)
            model = timm.create_model(name, num_classes=10).to(args.device).eval()
            model.load_state_dict(cpu.state_dict())
            xd = x.to(args.device)
            outs = [model(xd)]
            for dtype in (torch.bfloat16, torch.float16):
                with torch.autocast(args.device, dtype=dtype):
                    outs.append(model(xd))
            outs.append(model.half()(xd.half()))
        errs = [((o.float().cpu() - ref).norm() / ref.norm()).item() for o in outs]
        rows.append(f'| `{name}` | ' + ' | '.join(f'{e:.2e}' for e in errs) + ' |')
    return '\n'.join(rows)


def kernel_profile(args) -> str:
    """CUDA kernels per inference forward (bf16 autocast, batch 1), their summed time, and the forward's wall time."""
    from torch.profiler import ProfilerActivity, profile
    img = 32 if args.dry_run else 224
    rows = ['| model | px | aten ops | CUDA kernels | GPU busy ms | wall ms | busy / wall |',
            '|---|---:|---:|---:|---:|---:|---:|']
    for name in ('ssog_ode_tiny', 'odevit_tiny') if args.dry_run else (
            'ssog_ode_tiny', 'odevit_tiny', 'ssog_vit_tiny', 'dense_vit_tiny'):
        model = timm.create_model(name, img_size=img).to(args.device).eval()
        x = torch.randn(1, 3, img, img, device=args.device)

        def forward():
            with torch.inference_mode(), torch.autocast(args.device, dtype=torch.bfloat16):
                model(x)
        for _ in range(3):
            forward()
        with OpCounter() as counter:
            forward()
        wall = _median_ms(forward, args.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == 'cuda' else [])
        with profile(activities=activities) as prof:
            forward()
            if args.device == 'cuda':
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1000
        rows.append(f'| `{name}` | {img} | {counter.count} | {len(kernels)} | {busy:.2f} | {wall:.2f} | '
                    f'{busy / wall:.2f} |')
    return '\n'.join(rows)


def timings(args) -> str:
    """The benchmark three ways; each mode writes its own tables under OUT_DIR as each configuration finishes."""
    if args.dry_run:
        common = ['--device', 'cpu', '--resolutions', '32', '--batch-sizes', '1', '--repeats', '1', '--no-memory']
        modes = {'eager': []}  # compiling on the CPU takes minutes: the GPU run's modes are tested apart
    else:
        common = ['--device', 'cuda', '--resolutions', '224', '1024', '--batch-sizes', '1', '32', '--repeats', '5',
                  '--time-budget', '2']
        modes = {'eager': [], 'cudagraphs': ['--cuda-graphs'],
                 'reduce_overhead': ['--compile-mode', 'reduce-overhead', '--no-memory']}
    out = []
    for mode, extra in modes.items():
        prefix = f'timings_{mode}'
        cmd = [sys.executable, '-m', 'timm_odevit_tools.benchmark', '--settings', 'ode', '--widths',
               'tiny' if args.dry_run else 'small', '--variants', 'ssog', 'fused', 'floor', '--precision',
               'amp_bfloat16', '--out-dir', str(args.out), '--prefix', prefix] + common + extra
        limit = 40 if args.dry_run else 110
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
            status = f'exit {proc.returncode}' + ('' if proc.returncode == 0 else f': {proc.stderr[-500:]}')
        except subprocess.TimeoutExpired:
            status = f'cut at {limit} s (the finished configurations are in {prefix}.csv)'
        md = args.out / f'{prefix}.md'
        table = md.read_text().split('\n\n')[1] if md.exists() else '(nothing measured)'
        out.append(f'### {mode} ({status})\n\n{table}')
    return '\n\n'.join(out)


def mixing_paths(args) -> str:
    """One mixer (small width: 384, 6 heads, 4 components) on each path, bf16 autocast, inference: agreement with the
    einsum reference and median ms per call, by grid and batch."""
    grids = [(4, 4), (8, 8)] if args.dry_run else [(14, 14), (24, 24), (32, 32), (64, 64)]
    batches = [1, 2] if args.dry_run else [1, 32]
    # fused: the per-head matmuls; triton: the one-pass kernel (CUDA with Triton; its default waits on this table)
    paths = ['operator', 'accumulate', 'einsum', 'fused'] + (['triton'] if args.device == 'cuda' and HAS_TRITON else [])
    rows = ['| grid | batch | ' + ' | '.join(f'{p} ms' for p in paths) + ' | max rel. error |',
            '|---|---:|' + '---:|' * (len(paths) + 1)]
    torch.manual_seed(0)
    for grid in grids:
        for batch in batches:
            mixers = {p: SeparableGaussianMixer(384, 6, mixing=p).to(args.device).eval() for p in paths}
            for m in mixers.values():
                m.load_state_dict(mixers['einsum'].state_dict())
            x = torch.randn(batch, 1 + grid[0] * grid[1], 384, device=args.device)
            times, outs = {}, {}
            for p, m in mixers.items():
                with torch.inference_mode(), torch.autocast(args.device, dtype=torch.bfloat16):
                    outs[p] = m(x, grid).float()
                    times[p] = _median_ms(lambda: m(x, grid), args.device, 3 if args.dry_run else 10)
            ref = outs['einsum']
            err = max(((o - ref).norm() / ref.norm()).item() for o in outs.values())
            rows.append(f'| {grid[0]}x{grid[1]} | {batch} | ' + ' | '.join(f'{times[p]:.3f}' for p in paths)
                        + f' | {err:.1e} |')
    return '\n'.join(rows)


def training_profile(args) -> str:
    """One training step of the 32 px tiny pair at batch 512 (bf16 autocast): images/s and the ten CUDA kernels (CPU
    ops in a dry run) that take the most time."""
    from torch.profiler import ProfilerActivity, profile
    batch = 16 if args.dry_run else 512
    out = []
    for family in ('ssog_vit', 'dense_vit'):
        name = model_name(family, 'tiny', small_image=True)
        model = timm.create_model(name, num_classes=10, in_chans=1).to(args.device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, 1, 32, 32, device=args.device)
        y = torch.randint(0, 10, (batch,), device=args.device)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
        for _ in range(3):
            step()
        ms = _median_ms(step, args.device, 3 if args.dry_run else 10)
        cuda = args.device == 'cuda'
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by='cuda_time_total' if cuda else 'cpu_time_total', row_limit=10)
        out.append(f'### `{name}`, batch {batch}: {batch / ms * 1000:.0f} images/s ({ms:.1f} ms per step)\n\n'
                   f'```\n{table}\n```')
    return '\n\n'.join(out)


SECTIONS: Dict[str, Callable] = {
    # agreement first: a path that disagrees with the reference is not worth timing
    'versions': versions, 'precision: CUDA against CPU': precision, 'mixing paths': mixing_paths,
    'kernel profile': kernel_profile, 'timings: eager, CUDA graphs, reduce-overhead': timings,
    'training-step profile': training_profile,
}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('out', type=Path)
    p.add_argument('--dry-run', action='store_true', help='every section on the CPU at toy sizes')
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.device = 'cpu' if args.dry_run or not torch.cuda.is_available() else 'cuda'
    summary = args.out / 'summary.md'
    summary.write_text(f'# SSoG mixer GPU check ({time.strftime("%Y-%m-%d %H:%M")}, {args.device})\n')
    start, failed = time.time(), 0
    for title, section in SECTIONS.items():
        if time.time() - start > TOTAL_SECONDS:
            text, failed = f'skipped: the {TOTAL_SECONDS} s of the call are spent', failed + 1
        else:
            t0 = time.time()
            try:
                text = section(args)
            except Exception:  # noqa: BLE001 -- one section's failure must not lose the others
                text, failed = f'failed:\n\n```\n{traceback.format_exc()[-3000:]}\n```', failed + 1
            text += f'\n\n({time.time() - t0:.0f} s)'
        with summary.open('a') as f:
            f.write(f'\n## {title}\n\n{text}\n')
        print(f'## {title}\n{text}\n', flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
