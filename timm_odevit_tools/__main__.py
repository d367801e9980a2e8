"""The main job, ``python -m timm_odevit``: the line users type first,
``timm.create_model('ssog_ode_small', pretrained=True)``, served offline by the local Hub mirror from the weights
bundled with the package, classifies the bundled 1,000-image Fashion-MNIST sample; then the zoo tables.

Runs from any directory and from a normal (non-editable) install. Speed is the benchmark's job:
``python -m timm_odevit_tools.benchmark``.
"""
import argparse
from typing import List, Optional

import timm
import torch

from .hub.demo import DEFAULT_MODEL, main as pretrained_demo
from timm_odevit.models.families import SIZES
from .zoo import grid_table, paper_table, reduction_table, zoo_table


def main(argv: Optional[List[str]] = None) -> int:
    """Run the pretrained demo, then print the zoo tables; 1 when the demo failed (it says why)."""
    parser = argparse.ArgumentParser(prog='python -m timm_odevit', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--sizes', nargs='+', default=list(SIZES), choices=SIZES, help='model sizes in the table')
    parser.add_argument('--model', default=DEFAULT_MODEL, help='the pretrained model the demo loads')
    parser.add_argument('--threads', type=int, default=None, help='torch threads (default: torch decides)')
    parser.add_argument('--no-demo', action='store_true', help='skip the pretrained classification demo')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    status = 0
    if not args.no_demo:
        status = pretrained_demo(args.model)
        print()
    print(f'timm {timm.__version__}, torch {torch.__version__}; GMACs for one image at the model\'s default size. '
          'Speed: python -m timm_odevit_tools.benchmark\n')
    print(grid_table(), end='\n\n')
    print(zoo_table(args.sizes), end='\n\n')
    print(reduction_table(args.sizes), end='\n\n')
    print(paper_table())
    if status:
        print('\nThe pretrained demo failed (see its message above); the tables above need no weights.')
    return status


if __name__ == '__main__':
    raise SystemExit(main())
