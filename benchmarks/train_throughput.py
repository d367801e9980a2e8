"""Training and inference throughput, eager vs compiled, fp32 vs bf16, measured side by side in one process.

    OMP_NUM_THREADS=2 python benchmarks/train_throughput.py --out benchmarks/compile_cpu.md
    python benchmarks/train_throughput.py --device cuda --modes 'eager bf16' 'compiled bf16'   # the GPU script's

Training: one AdamW step (cross-entropy, batch 128, 32 px, 10 classes) of a tiny 32 px model per depth setting, in
four modes: eager and torch.compile (inductor), each in fp32 and under bf16 autocast. Inference: one batch-1 forward
at 1024 px of ``ssog_ode_tiny`` eager vs compiled. The modes of a model are timed interleaved (A B C A B C ...) so
that load from other processes hits them alike; medians of ``--repeats`` and the ratios are printed as Markdown.
"""
import argparse
import contextlib
import statistics
import time
from typing import Callable, Dict, List

import timm
import torch
import torch.nn.functional as F

import timm_odevit  # noqa: F401  (registers the models)
from timm_odevit.models.families import FAMILIES, SETTINGS, model_name

MODES = ('eager fp32', 'compiled fp32', 'eager bf16', 'compiled bf16')


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)  # a step is timed to its end, not to its launch


def train_step_fn(name: str, mode: str, batch_size: int, device: torch.device) -> Callable[[], None]:
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = torch.compile(model) if mode.startswith('compiled') else model
    bf16 = mode.endswith('bf16')
    x = torch.randn(batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)

    def step() -> None:
        with _autocast(device, bf16):
            loss = F.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
    return step


def infer_fn(name: str, compiled: bool, img_size: int, device: torch.device) -> Callable[[], None]:
    model = timm.create_model(name, img_size=img_size).eval().to(device)
    run = torch.compile(model) if compiled else model
    x = torch.randn(1, 3, img_size, img_size, device=device)

    def step() -> None:
        with torch.inference_mode():
            run(x)
        _sync(device)
    return step


def interleaved_medians(fns: Dict[str, Callable[[], None]], repeats: int, warmup: int = 2) -> Dict[str, float]:
    """Median seconds per call of each function, timed A B C A B C ... after ``warmup`` untimed rounds (which
    include compilation). Build the functions after ``torch._dynamo.reset()``: one process compiling model after
    model reaches dynamo's recompile limit (8 per function), and the later models then run eagerly, silently."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def cpu_description() -> str:
    """The CPU model and whether it has native bf16 (avx512_bf16 or AMX): without it, bf16 matmuls are emulated and
    bf16 autocast loses to fp32, so a table is read only beside this."""
    try:
        info = open('/proc/cpuinfo').read()
    except OSError:
        return 'CPU (no /proc/cpuinfo)'
    model = next((ln.split(':', 1)[1].strip() for ln in info.splitlines() if ln.startswith('model name')), 'CPU')
    flags = set(next((ln.split(':', 1)[1].split() for ln in info.splitlines() if ln.startswith('flags')), []))
    native = sorted(flags & {'avx512_bf16', 'amx_bf16'})
    return f'{model}, native bf16: {", ".join(native) if native else "none"}'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--repeats', type=int, default=7)
    p.add_argument('--infer-img-size', type=int, default=1024, help='0: no inference table')
    p.add_argument('--out', default=None, help='also write the Markdown tables here')
    p.add_argument('--device', default='cpu')
    p.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES, help='training modes to time')
    p.add_argument('--families', nargs='+', default=[ssog for ssog, _ in SETTINGS.values()],
                   choices=[f.name for f in FAMILIES.values() if f.is_ssog],
                   help='SSoG families, each with its dense twin (default: the fixed-kernel ones)')
    args = p.parse_args()
    device = torch.device(args.device)
    modes = [m for m in MODES if m in args.modes]
    # a ratio is printed where both of its modes ran
    ratios = [(a, b, label) for a, b, label in (('eager bf16', 'eager fp32', 'bf16 / fp32, eager'),
                                                ('compiled fp32', 'eager fp32', 'compiled / eager, fp32'),
                                                ('compiled bf16', 'eager bf16', 'compiled / eager, bf16'))
              if a in modes and b in modes]
    threads = f'{cpu_description()}, {torch.get_num_threads()} threads' if device.type == 'cpu' else str(device)
    lines = [f'torch {torch.__version__}, {threads}, training batch {args.batch_size}, '
             f'median of {args.repeats} interleaved repeats', '',
             '| model | ' + ' | '.join([f'{m} (img/s)' for m in modes] + [label for _, _, label in ratios]) + ' |',
             '|---|' + '---:|' * (len(modes) + len(ratios))]
    print('\n'.join(lines), flush=True)  # each row follows as it is measured: a run cut short keeps its table
    # each SSoG model, then its twin unless an earlier family had it
    names = dict.fromkeys(model_name(n, 'tiny', True) for f in args.families for n in (f, FAMILIES[f].twin))
    for name in names:
        torch._dynamo.reset()
        med = interleaved_medians({m: train_step_fn(name, m, args.batch_size, device) for m in modes}, args.repeats)
        ips = {m: args.batch_size / med[m] for m in modes}
        lines.append(f'| `{name}` | ' + ' | '.join([f'{ips[m]:.0f}' for m in modes]
                                                   + [f'{ips[a] / ips[b]:.2f}x' for a, b, _ in ratios]) + ' |')
        print(lines[-1], flush=True)
    if args.infer_img_size > 0:
        lines += ['', f'Inference, batch 1, {args.infer_img_size} px, fp32:', '',
                  '| model | eager (ms) | compiled (ms) | compiled speed-up |', '|---|---:|---:|---:|']
        print('\n'.join(lines[-5:]), flush=True)
        for name in ('ssog_ode_tiny', 'odevit_tiny'):
            torch._dynamo.reset()
            med = interleaved_medians({c: infer_fn(name, c, args.infer_img_size, device) for c in (False, True)},
                                      max(3, args.repeats // 2))
            lines.append(f'| `{name}` | {med[False] * 1e3:.0f} | {med[True] * 1e3:.0f} '
                         f'| {med[False] / med[True]:.2f}x |')
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, 'w') as f:
            f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
    main()
