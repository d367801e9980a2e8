"""Training and inference throughput, eager vs compiled, fp32 vs bf16, measured side by side in one process.

    OMP_NUM_THREADS=2 python benchmarks/train_throughput.py --out benchmarks/compile_cpu.md

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
from timm_odevit.models.families import FAMILIES, model_name

MODES = ('eager fp32', 'compiled fp32', 'eager bf16', 'compiled bf16')


def _autocast(bf16: bool) -> contextlib.AbstractContextManager:
    return torch.autocast('cpu', dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def train_step_fn(name: str, mode: str, batch_size: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = torch.compile(model) if mode.startswith('compiled') else model
    bf16 = mode.endswith('bf16')
    x, y = torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))

    def step() -> None:
        with _autocast(bf16):
            loss = F.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def infer_fn(name: str, compiled: bool, img_size: int) -> Callable[[], None]:
    model = timm.create_model(name, img_size=img_size).eval()
    run = torch.compile(model) if compiled else model
    x = torch.randn(1, 3, img_size, img_size)

    def step() -> None:
        with torch.inference_mode():
            run(x)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--repeats', type=int, default=7)
    p.add_argument('--infer-img-size', type=int, default=1024)
    p.add_argument('--out', default=None, help='also write the Markdown tables here')
    args = p.parse_args()
    lines = [f'torch {torch.__version__}, {torch.get_num_threads()} threads, training batch {args.batch_size}, '
             f'median of {args.repeats} interleaved repeats', '',
             '| model | ' + ' | '.join(f'{m} (img/s)' for m in MODES)
             + ' | bf16 / fp32, eager | compiled / eager, fp32 | compiled / eager, bf16 |',
             '|---|' + '---:|' * (len(MODES) + 3)]
    for family in (f for f in FAMILIES.values() if f.is_ssog):
        for name in (model_name(family.name, 'tiny', True), model_name(family.twin, 'tiny', True)):
            torch._dynamo.reset()
            med = interleaved_medians({m: train_step_fn(name, m, args.batch_size) for m in MODES}, args.repeats)
            ips = {m: args.batch_size / med[m] for m in MODES}
            lines.append(f'| `{name}` | ' + ' | '.join(f'{ips[m]:.0f}' for m in MODES)
                         + f' | {ips["eager bf16"] / ips["eager fp32"]:.2f}x'
                         f' | {ips["compiled fp32"] / ips["eager fp32"]:.2f}x'
                         f' | {ips["compiled bf16"] / ips["eager bf16"]:.2f}x |')
            print(lines[-1], flush=True)
    lines += ['', f'Inference, batch 1, {args.infer_img_size} px, fp32:', '',
              '| model | eager (ms) | compiled (ms) | compiled speed-up |', '|---|---:|---:|---:|']
    for name in ('ssog_ode_tiny', 'odevit_tiny'):
        torch._dynamo.reset()
        med = interleaved_medians({c: infer_fn(name, c, args.infer_img_size) for c in (False, True)},
                                  max(3, args.repeats // 2))
        lines.append(f'| `{name}` | {med[False] * 1e3:.0f} | {med[True] * 1e3:.0f} | {med[False] / med[True]:.2f}x |')
        print(lines[-1], flush=True)
    text = '\n'.join(lines)
    print(text)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text + '\n')


if __name__ == '__main__':
    main()
