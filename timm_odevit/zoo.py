"""The main job, ``python -m timm_odevit``: a pretrained model loaded through the local Hub mirror classifies the
bundled Fashion-MNIST sample; then the zoo at a glance, every family's params, GMACs, NFE and a quick side-by-side
speed ratio of each SSoG model against its dense twin, the parameter reductions and the ODE-ViT paper configs' counts.
"""
import argparse
import statistics
import time
from typing import Dict, List, Optional

import timm
import torch

from . import models  # noqa: F401  (registers the models)
from .benchmark.runner import count_gmacs

# family -> its dense-attention twin (None for the dense families themselves)
FAMILIES: Dict[str, Optional[str]] = {
    'ssog_vit': 'dense_vit',
    'looped_ssog': 'looped_vit',
    'ssog_ode': 'odevit',
    'dense_vit': None,
    'looped_vit': None,
    'odevit': None,
}
# ODE-ViT paper configurations -> the trainable-parameter count the paper reports
PAPER_CONFIGS: Dict[str, float] = {
    'odevit_w768_mlp1_36pt': 3.8e6,
    'odevit_w768_mlp4_24pt': 7.0e6,
}
PAPER_NUM_CLASSES = 100  # the paper's counts are for its CIFAR-100 students


def count_params(name: str, **kwargs) -> int:
    model = timm.create_model(name, device='meta', **kwargs)
    return sum(p.numel() for p in model.parameters())


def param_reduction(ssog_name: str, dense_name: str) -> float:
    """Percent fewer parameters in the SSoG model than in its dense twin."""
    ssog, dense = count_params(ssog_name), count_params(dense_name)
    return 100. * (dense - ssog) / dense


def paper_trainable_params(name: str) -> int:
    """Trainable parameters as the ODE-ViT paper counts them for its teacher-guided students: the patch embedding,
    CLS token and position embedding are copied from the teacher and frozen; the vector field (attention, MLP,
    two CenterNorms), the 10 registers and a 100-class head train."""
    model = timm.create_model(name, device='meta', num_classes=PAPER_NUM_CLASSES)
    for frozen in (model.patch_embed, model.cls_token, model.pos_embed):
        frozen.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def median_forward_seconds(models_: List[torch.nn.Module], img_size: int, repeats: int) -> List[float]:
    """Interleaved (A B A B ...) timing of batch-1 inference, warm-up excluded; the median for each model."""
    x = torch.randn(1, 3, img_size, img_size)
    times: List[List[float]] = [[] for _ in models_]
    with torch.inference_mode():
        for m in models_:
            m(x)
        for _ in range(repeats):
            for i, m in enumerate(models_):
                start = time.perf_counter()
                m(x)
                times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def zoo_table(sizes: List[str], repeats: int) -> str:
    rows = ['| model | params (M) | GMACs | NFE | speed vs dense twin (median, batch 1) |',
            '|---|---:|---:|---:|---:|']
    for size in sizes:
        for family, twin in FAMILIES.items():
            name = f'{family}_{size}'
            model = timm.create_model(name).eval()
            img = model.pretrained_cfg['input_size'][-1]
            params = sum(p.numel() for p in model.parameters()) / 1e6
            macs = count_gmacs(model, img)
            nfe = model.nfe
            speed = ''
            if twin is not None:
                dense = timm.create_model(f'{twin}_{size}').eval()
                t_ssog, t_dense = median_forward_seconds([model, dense], img, repeats)
                speed = f'{t_dense / t_ssog:.2f}x'
            rows.append(f'| `{name}` | {params:.2f} | {macs:.2f} | {nfe} | {speed} |')
    return '\n'.join(rows)


def reduction_table(sizes: List[str]) -> str:
    rows = ['| SSoG model | dense twin | fewer params |', '|---|---|---:|']
    for size in sizes:
        for family, twin in FAMILIES.items():
            if twin is not None:
                for suffix in ('', '_patch4_32'):
                    a, b = f'{family}_{size}{suffix}', f'{twin}_{size}{suffix}'
                    rows.append(f'| `{a}` | `{b}` | {param_reduction(a, b):.1f}% |')
    return '\n'.join(rows)


def paper_table() -> str:
    rows = ['| config | trainable params (paper count) | paper | difference |', '|---|---:|---:|---:|']
    for name, target in PAPER_CONFIGS.items():
        n = paper_trainable_params(name)
        rows.append(f'| `{name}` | {n / 1e6:.3f}M | {target / 1e6:.1f}M | {100 * (n - target) / target:+.1f}% |')
    return '\n'.join(rows)


def main(argv: Optional[List[str]] = None) -> None:
    """Run the demo and print the zoo tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--sizes', nargs='+', default=['tiny', 'small', 'base'], choices=['tiny', 'small', 'base'])
    parser.add_argument('--repeats', type=int, default=5, help='timed forwards per model for the speed ratio')
    parser.add_argument('--threads', type=int, default=None, help='torch threads (default: torch decides)')
    parser.add_argument('--no-demo', action='store_true', help='skip the pretrained classification demo')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not args.no_demo:
        from .hub.demo import main as pretrained_demo
        if pretrained_demo() != 0:
            raise SystemExit('the pretrained demo failed (see above)')
        print()
    print(f'timm {timm.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, 224 px models\n')
    print(zoo_table(args.sizes, args.repeats), end='\n\n')
    print(reduction_table(args.sizes), end='\n\n')
    print(paper_table())


if __name__ == '__main__':
    main()
