"""Peak live memory of the SSoG op's forward and of its backward, on the CPU (the per-head body `fused` runs off the
Triton kernel): 1024 px at small width (a 64 x 64 grid, 6 heads of 64 channels, 4 components), one prefix token.

    python benchmarks/op_memory.py [--batch 8]

Counted by the benchmark's ``LiveStorageTracker`` (the peak of the storages created inside each step, the step's
output and gradients included), so the figures do not depend on the machine.
"""
import argparse

import torch

from timm_odevit.layers import SeparableGaussianMixer
from timm_odevit.layers.fused_mixer import separable_mix
from timm_odevit_tools.benchmark.runner import LiveStorageTracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--batch', type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    H = W = 64
    heads, D = 6, 64
    factors = SeparableGaussianMixer(dim=heads * D, num_heads=heads).kernel_factors((H, W))[:4]
    leaves = [t.detach().requires_grad_() for t in factors]
    v = torch.randn(args.batch, 1 + H * W, heads * D, requires_grad=True)
    with LiveStorageTracker() as forward:
        y = separable_mix(v, *leaves, H, W, True)
    grad = torch.randn_like(y)
    with LiveStorageTracker() as backward:
        y.backward(grad)
    values = v.numel() * v.element_size()
    print(f'values {values / 2 ** 20:.1f} MiB; forward peak {forward.peak / values:.2f}x the values; backward peak '
          f'{backward.peak / values:.2f}x the values, {backward.peak / forward.peak:.2f}x the forward\'s')


if __name__ == '__main__':
    main()
