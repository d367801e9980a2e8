"""Where the SSoG mixer's N x N operator stops paying against the one-op separable mixing on this machine.

``python benchmarks/mixing_crossover.py --resolutions 224 384 512 640 --batch-sizes 1 8`` builds ``ssog_ode_tiny``
once per mixing path (same weights), and prints per resolution and batch the median ms of an inference forward under
bf16 autocast (interleaved repeats) and the operator's time over the others'. ``auto`` takes the operator up to
``OPERATOR_MAX_PATCHES`` patches; this is what sets it (docs/benchmark.md, "SSoG mixing paths").
"""
import argparse
import statistics
import time

import timm
import torch

import timm_odevit  # noqa: F401  (registers the models)

PATHS = ('operator', 'fused', 'accumulate')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='ssog_ode_tiny')
    p.add_argument('--resolutions', type=int, nargs='+', default=[224, 384, 512, 640])
    p.add_argument('--batch-sizes', type=int, nargs='+', default=[1, 8])
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--threads', type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for res in a.resolutions:
        models = {m: timm.create_model(a.model, img_size=res, ssog_mixing=m).eval() for m in PATHS}
        for m in models.values():
            m.load_state_dict(models['operator'].state_dict())
        patches = models['operator'].patch_embed.num_patches
        for batch in a.batch_sizes:
            x = torch.randn(batch, 3, res, res)
            times = {m: [] for m in PATHS}
            with torch.inference_mode(), torch.autocast('cpu', dtype=torch.bfloat16):
                for m in PATHS:
                    models[m](x)  # builds the kernels a stream of inference keeps
                for _ in range(a.repeats):
                    for m in PATHS:
                        start = time.perf_counter()
                        models[m](x)
                        times[m].append(time.perf_counter() - start)
            ms = {m: 1000 * statistics.median(t) for m, t in times.items()}
            print(f'{res} px, {patches} patches, batch {batch}: '
                  + ' '.join(f'{m}={ms[m]:.1f}ms' for m in PATHS)
                  + f' operator/fused={ms["operator"] / ms["fused"]:.2f} '
                  + f'operator/accumulate={ms["operator"] / ms["accumulate"]:.2f}', flush=True)


if __name__ == '__main__':
    main()
