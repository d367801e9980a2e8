"""Predicted time per mixer call on an H100 (SXM, bf16), for a GPU run to refute: each SSoG mixing path and SDPA's
flash, cuDNN and memory-efficient backends, forward only, at batch 32, head dim 64, 3 and 6 heads, N = 197, 1025 and
4097 tokens (a CLS token and a 14, 32 or 64 wide patch grid), K = 4 Gaussian components.

Each path's time is the larger of its FLOPs over the peak it can reach and its bytes over HBM bandwidth, plus a
launch cost per kernel. The peaks are published figures, not measurements: dense bf16 tensor cores 989 TFLOP/s, of
which cuBLAS reaches about 60% on these skinny shapes; FlashAttention-2 about 320 TFLOP/s and cuDNN / FA3 about 450
at head dim 64 (the FA3 paper); the memory-efficient backend about half of FA2; CUDA-core fp32 FMAs 67 TFLOP/s; HBM3
3.35 TB/s; 5 us per launch. The Triton kernel: its y axis runs as CUDA-core FMAs (B x heads x K x N x H x d of them),
a quarter of its inner loop's instructions (the rest: exp, gathers and masks of G^y), so 4x their time, plus its
x-axis tensor-core dots, redone per block of 16 rows.

    python benchmarks/gpu_cost_model.py
"""
from typing import Dict, List

PEAK_TC = 989e12 * 0.6      # cuBLAS bf16 on skinny shapes
PEAK_FA2, PEAK_CUDNN, PEAK_MEM_EFFICIENT = 320e12, 450e12, 160e12
PEAK_FP32 = 67e12
HBM = 3.35e12
LAUNCH = 5e-6
B, D, K, BYTES = 32, 64, 4, 2


def predictions(n_tokens: int, heads: int) -> Dict[str, float]:
    """Seconds per forward call of each path."""
    side = int(round((n_tokens - 1) ** 0.5))
    H = W = side
    N, C = n_tokens, heads * D
    values = B * N * C * BYTES  # one read or write of the values
    sdpa_flops = 4 * B * heads * N * N * D
    out = {f'sdpa {name}': sdpa_flops / peak + 3 * values / HBM + LAUNCH
           for name, peak in (('flash', PEAK_FA2), ('cudnn', PEAK_CUDNN), ('memory-efficient', PEAK_MEM_EFFICIENT))}
    separable_flops = 2 * B * heads * K * D * H * W * (H + W)
    kfold = B * heads * K * H * W * D * BYTES  # all heads' K-fold intermediate, written and read once
    # fused (per-head matmuls): per head a kernel expansion, the x-axis mm, the y-axis bmm, the copy
    out['fused (per-head matmuls)'] = max(separable_flops / PEAK_TC, (3 * values + 2 * kfold) / HBM) \
        + heads * 5 * LAUNCH
    # accumulate: per component two bmm over the values and an accumulation
    out['accumulate'] = max(separable_flops / PEAK_TC, (K * 3 * values + 2 * kfold) / HBM) + K * 4 * LAUNCH
    operator_flops = 2 * B * N * N * C
    out['operator (N x N)'] = max(operator_flops / PEAK_TC, (N * N * BYTES + 2 * values) / HBM) + 2 * LAUNCH
    y_fmas = B * heads * K * N * H * D
    x_dots = 2 * B * heads * K * H * (-(-H // 16)) * W * W * D
    out['triton (one pass)'] = 4 * 2 * y_fmas / PEAK_FP32 + x_dots / PEAK_TC + LAUNCH
    return out


def table() -> str:
    shapes = [(n, h) for h in (3, 6) for n in (197, 1025, 4097)]
    rows: List[str] = ['| path | ' + ' | '.join(f'N={n}, {h} heads' for n, h in shapes) + ' |',
                       '|---|' + '---:|' * len(shapes)]
    preds = [predictions(n, h) for n, h in shapes]
    for path in preds[0]:
        rows.append(f'| {path} | ' + ' | '.join(f'{p[path] * 1e3:.3f}' for p in preds) + ' |')
    return '\n'.join(rows) + '\n\nPredicted ms per forward call, batch 32, head dim 64, bf16, one H100 SXM.'


if __name__ == '__main__':
    print(table())
