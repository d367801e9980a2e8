"""``python -m timm_odevit.benchmark``: SSoG vs dense attention vs the identity floor, across resolutions."""
import argparse
import os
import sys
from typing import List, Optional

import torch
from tqdm import tqdm

from .runner import (
    SETTINGS, VARIANTS, WIDTHS, BenchmarkConfigError, Case, markdown_table, measure_memory, plot, ratio_rows,
    time_interleaved, validate, write_csv,
)

QUICK = dict(widths=['tiny'], resolutions=[224, 384], repeats=3, warmup=1)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog='python -m timm_odevit.benchmark', description=__doc__)
    p.add_argument('--settings', nargs='+', default=list(SETTINGS), help='depth settings: discrete looped ode')
    p.add_argument('--widths', nargs='+', default=['tiny'], help=f'widths among {list(WIDTHS)}')
    p.add_argument('--resolutions', nargs='+', type=int, default=[224, 384, 512, 768, 1024])
    p.add_argument('--batch-size', type=int, default=None, help='matched batch size (default: 2 on CPU, 32 on CUDA)')
    p.add_argument('--repeats', type=int, default=5, help='timed repeats per model, interleaved')
    p.add_argument('--warmup', type=int, default=1, help='untimed repeats first')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--no-train', action='store_true', help='inference only')
    p.add_argument('--no-memory', action='store_true', help='skip the peak-memory measurement')
    p.add_argument('--threads', type=int, default=None, help='torch threads on CPU')
    p.add_argument('--out-dir', default='benchmark_out', help='where the CSV, Markdown and PNG go')
    p.add_argument('--quick', action='store_true',
                   help=f'preset that finishes in under five minutes on 2 CPU cores: {QUICK}')
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.batch_size is None:
        args.batch_size = 32 if args.device.startswith('cuda') else 2
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        validate(args.settings, args.widths, args.resolutions)
    except BenchmarkConfigError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name() if args.device.startswith('cuda') else \
        f'CPU, {torch.get_num_threads()} threads'
    os.makedirs(args.out_dir, exist_ok=True)
    groups = [(s, w, r) for r in args.resolutions for s in args.settings for w in args.widths]
    rows = []
    bar = tqdm(total=len(groups) * (1 + (not args.no_memory) * len(VARIANTS)), desc='benchmark', unit='step')
    for setting, width, img in groups:
        cases = [Case(setting, width, v, img, args.batch_size) for v in VARIANTS]
        bar.set_postfix_str(f'{setting} {width} {img}px timing')
        results = time_interleaved(cases, args.repeats, args.warmup, args.device, dtype, do_train=not args.no_train)
        bar.update(1)
        for r in results:
            if not args.no_memory and r.status == 'ok':
                bar.set_postfix_str(f'{r.case.label} memory')
                status, mem = measure_memory(r.case, args.device, dtype, do_train=not args.no_train)
                r.status = status
                r.infer_mem_mb, r.train_mem_mb = mem.get('infer'), mem.get('train')
            if not args.no_memory:
                bar.update(1)
            rows.append(r.row(device_name))
    bar.close()

    csv_path = os.path.join(args.out_dir, 'benchmark.csv')
    md_path = os.path.join(args.out_dir, 'benchmark.md')
    png_path = os.path.join(args.out_dir, 'benchmark.png')
    write_csv(rows, csv_path)
    table = markdown_table(ratio_rows(rows))
    header = (f'Device: {device_name}; batch {args.batch_size}; {args.dtype}; medians of {args.repeats} interleaved '
              f'repeats after {args.warmup} warm-up.\n\n')
    with open(md_path, 'w') as f:
        f.write(header + table + '\n')
    plot(rows, png_path, f'timm_odevit benchmark on {device_name}, batch {args.batch_size}')
    print(header + table)
    for r in rows:
        if r['status'] != 'ok':
            print(f"{r['model']}: {r['status']}")
    print(f'\nwrote {csv_path}, {md_path}, {png_path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
