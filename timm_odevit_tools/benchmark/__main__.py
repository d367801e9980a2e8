"""``python -m timm_odevit_tools.benchmark``: SSoG vs dense attention (fused and eager) vs the identity floor."""
import argparse
import os
import sys
import time
from typing import List, Optional

import torch
from tqdm import tqdm

from ..cli import run_command

from .runner import (
    ALL_VARIANTS, COMPILE_MODES, COMPILED_WARMUP, PRECISIONS, SETTINGS, SIZES, VARIANTS, BenchmarkConfigError, Case,
    absolute_table, markdown_table, measure_memory, memory_budget, parse_precision, plot, ratio_rows, read_csv,
    runnable, time_interleaved, validate, write_csv,
)

QUICK = dict(widths=['tiny'], resolutions=[224, 384], batch_sizes=[1], repeats=3, warmup=1)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog='python -m timm_odevit_tools.benchmark', description=__doc__)
    p.add_argument('--settings', nargs='+', default=list(SETTINGS), help=f'depth settings among {list(SETTINGS)}')
    p.add_argument('--widths', nargs='+', default=['tiny'], help=f'widths among {list(SIZES)}')
    p.add_argument('--variants', nargs='+', default=list(VARIANTS), help=f'among {list(ALL_VARIANTS)}')
    p.add_argument('--resolutions', nargs='+', type=int, default=[224, 384, 512, 768, 1024])
    p.add_argument('--batch-sizes', nargs='+', type=int, default=None,
                   help='matched batch sizes, each a run of its own (default: 1 8 on CPU, 1 32 on CUDA)')
    p.add_argument('--repeats', type=int, default=5, help='timed repeats per model, interleaved')
    p.add_argument('--warmup', type=int, default=1, help='untimed repeats first')
    p.add_argument('--time-budget', type=float, default=None,
                   help='seconds per configuration and step kind: fewer repeats where one round takes longer')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--precision', default='float32', choices=PRECISIONS,
                   help="'bfloat16': weights and input in bf16; 'amp_bfloat16': float32 weights, bf16 autocast")
    p.add_argument('--compile', action='store_true',
                   help='torch.compile every model in the default mode (times include no compile; no CUDA graphs)')
    p.add_argument('--compile-mode', default=None, choices=COMPILE_MODES,
                   help="torch.compile mode (implies --compile): 'reduce-overhead' records CUDA graphs, "
                        "'max-autotune' also tunes the kernels; compiled models get at least "
                        f"{COMPILED_WARMUP} untimed calls first")
    p.add_argument('--cuda-graphs', action='store_true',
                   help='capture each eager step into a CUDA graph once and time its replays (CUDA only; memory is '
                        'not measured for them: a replay allocates nothing)')
    p.add_argument('--no-train', action='store_true', help='inference only')
    p.add_argument('--no-memory', action='store_true', help='skip the peak-memory measurement (reported n/a)')
    p.add_argument('--no-timing', action='store_true', help='memory (and MACs) only: no timed steps')
    p.add_argument('--memory-budget-gb', type=float, default=None,
                   help='what one configuration may use (default: 85%% of the GPU, 40%% of available host memory); '
                        'eager maps estimated above it are skipped, a CPU memory child is limited to it')
    p.add_argument('--threads', type=int, default=None, help='torch threads on CPU')
    p.add_argument('--out-dir', default='benchmark_out', help='where the CSV, Markdown and PNG go')
    p.add_argument('--prefix', default='benchmark', help='file name stem of the outputs')
    p.add_argument('--plot-only', metavar='CSV', default=None, help='redraw the Markdown and PNG of a CSV and exit')
    p.add_argument('--quick', action='store_true',
                   help=f'preset that finishes in under five minutes on 2 CPU cores: {QUICK}')
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.compile_mode:
        args.compile = True
    args.compile_mode = args.compile_mode or 'default'
    if args.batch_sizes is None:
        args.batch_sizes = [1, 32] if args.device.startswith('cuda') else [1, 8]
    return args


def write_reports(rows, out_dir: str, prefix: str, header: str, title: str, png: bool = True) -> List[str]:
    paths = [os.path.join(out_dir, f'{prefix}.{ext}') for ext in ('csv', 'md', 'png')]
    write_csv(rows, paths[0])
    with open(paths[1], 'w') as f:
        f.write(header + markdown_table(ratio_rows(rows)) + '\n\n' + absolute_table(rows) + '\n')
    if png:
        plot(rows, paths[2], title)
    return paths if png else paths[:2]


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.plot_only:
        rows = read_csv(args.plot_only)
        paths = write_reports(rows, args.out_dir, args.prefix, f'Redrawn from {args.plot_only}.\n\n',
                              f'timm_odevit benchmark ({args.plot_only})')
        print(markdown_table(ratio_rows(rows)))
        print(f'\nwrote {", ".join(paths)}')
        return 0
    try:
        validate(args.settings, args.widths, args.resolutions, args.variants, args.batch_sizes, args.repeats)
        dtype, amp_dtype = parse_precision(args.precision)
        if args.warmup < 0:
            raise BenchmarkConfigError(f'--warmup {args.warmup} is negative; give 0 or more.')
        if args.cuda_graphs and (args.compile or not args.device.startswith('cuda')):
            raise BenchmarkConfigError('--cuda-graphs captures eager models on a CUDA device: drop --compile (use '
                                       "--compile-mode reduce-overhead for compiled graphs) or run on --device cuda.")
    except BenchmarkConfigError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith('cuda')
    device_name = torch.cuda.get_device_name() if cuda else f'CPU, {torch.get_num_threads()} threads'
    budget = int(args.memory_budget_gb * 2 ** 30) if args.memory_budget_gb else memory_budget(args.device)
    groups = [(s, w, r, b) for r in args.resolutions for b in args.batch_sizes for s in args.settings
              for w in args.widths]
    rows = []
    header = (f'Device: {device_name}; torch {torch.__version__}; precision {args.precision} '
              f'({"autocast" if amp_dtype else "weights and input"}); '
              f'{f"compiled ({args.compile_mode} mode)" if args.compile else "eager"}'
              f'{", CUDA graphs" if args.cuda_graphs else ""}; batch sizes {args.batch_sizes}; medians of up to '
              f'{args.repeats} interleaved repeats after {args.warmup} warm-up'
              f'{f", at most {args.time_budget:g} s per configuration and step kind" if args.time_budget else ""}. '
              f'Memory: {"not measured" if args.no_memory else "allocator-level peak above weights and input"}.\n\n')
    title = f'timm_odevit benchmark on {device_name}, {args.precision}'
    bar = tqdm(total=len(groups) * (1 + (not args.no_memory) * len(args.variants)), desc='benchmark', unit='step')
    start = time.time()
    for setting, width, img, batch in groups:
        if args.compile:
            # each group compiles fresh models: without a reset, dynamo's recompile limit (8 per function) is reached
            # after a group or two and the later models run eagerly, silently
            torch._dynamo.reset()
        cases = [Case(setting, width, v, img, batch, args.compile, args.compile_mode, args.cuda_graphs)
                 for v in args.variants]
        bar.set_postfix_str(f'{setting} {width} {img}px b{batch} timing')
        results = time_interleaved(cases, 0 if args.no_timing else args.repeats, 0 if args.no_timing else args.warmup,
                                   args.device, dtype, not args.no_train,
                                   amp_dtype=amp_dtype, time_budget=args.time_budget, precision=args.precision,
                                   budget=budget)
        bar.update(1)
        for r in results:
            if not args.no_memory and not args.cuda_graphs:
                if runnable(r.status):
                    bar.set_postfix_str(f'{r.case.label} memory')
                    train = not args.no_train and r.status == 'ok'
                    status, r.mem = measure_memory(r.case, args.device, dtype, train, amp_dtype=amp_dtype,
                                                   budget=budget, model=r.model)
                    r.status = r.status if status == 'ok' else status
                bar.update(1)
            r.model = None
            rows.append(r.row(device_name))
        # the tables after every group: a run cut short still leaves what it measured
        write_reports(rows, args.out_dir, args.prefix, header, title, png=False)
    bar.close()
    paths = write_reports(rows, args.out_dir, args.prefix, header, title)
    print(header + markdown_table(ratio_rows(rows)) + '\n\n' + absolute_table(rows))
    for r in rows:
        if r['status'] != 'ok':
            print(f"{r['model']}: {r['status']}")
    print(f'\nwrote {", ".join(paths)} in {time.time() - start:.0f} s')
    return 0


if __name__ == '__main__':
    sys.exit(run_command(main, 'python -m timm_odevit_tools.benchmark'))
