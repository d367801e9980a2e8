"""``python -m timm_odevit_tools.data layout|sample``: lay Fashion-MNIST's IDX files out for torchvision and timm,
or write the seeded test sample. A module of its own, so that running it never re-executes the package the models
import."""
import argparse
from typing import Optional, Sequence

from ..cli import run_command

from . import DEBIAN_FASHION_MNIST, SAMPLE_DIR, __doc__ as PACKAGE_DOC, layout_fashion_mnist, make_sample


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog='python -m timm_odevit_tools.data', description=PACKAGE_DOC.split('\n')[0])
    sub = p.add_subparsers(dest='cmd', required=True)
    lay = sub.add_parser('layout', help='lay IDX files out as <root>/FashionMNIST/raw/')
    lay.add_argument('--src', default=None, help='folder of IDX files (default: Debian package, else the sample)')
    lay.add_argument('--root', default='data')
    smp = sub.add_parser('sample', help='write the seeded test sample')
    smp.add_argument('--src', default=str(DEBIAN_FASHION_MNIST))
    smp.add_argument('--dst', default=str(SAMPLE_DIR))
    smp.add_argument('-n', type=int, default=1000)
    smp.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == 'layout':
        root = layout_fashion_mnist(args.src, args.root)
        print(f'{root}/FashionMNIST/raw ready: torchvision FashionMNIST(root={str(root)!r}) or timm '
              f'--dataset torch/fashion_mnist --data-dir {root}')
    else:
        info = make_sample(args.src, args.dst, args.n, args.seed)
        print(f'wrote {args.n} test images (seed {args.seed}) to {args.dst}; classes {info["class_counts"]}')


if __name__ == '__main__':
    raise SystemExit(run_command(main, 'python -m timm_odevit_tools.data'))
