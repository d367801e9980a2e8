"""Predicted time per mixer call on an H100 (SXM, bf16), for a GPU run to refute: each SSoG mixing path and SDPA's
flash, cuDNN and memory-efficient backends, forward only, at batch 32, head dim 64, 3 and 6 heads, N = 197, 1025 and
4097 tokens (a CLS token and a 14, 32 or 64 wide patch grid), K = 4 Gaussian components.

Each path's time is the larger of its FLOPs over the peak it can reach and its bytes over HBM bandwidth, plus a
launch cost per kernel. The peaks are published figures, not measurements: dense bf16 tensor cores 989 TFLOP/s, of
which cuBLAS reaches about 60% on these skinny shapes; FlashAttention-2 about 320 TFLOP/s and cuDNN / FA3 about 450
at head dim 64 (the FA3 paper); the memory-efficient backend about half of FA2; HBM3
3.35 TB/s; 5 us per launch. The Triton kernel: both axes as tensor-core dots on tiles padded to 16 (the y axis per
block of 16 output rows and 16 source rows, the x axis on the block's own rows against the row padded to a power of
two), at cuBLAS's fraction of the peak; its programs read their head's values once per component and 16-row block
(counted at HBM, an upper bound where L2 holds them).

    python benchmarks/gpu_cost_model.py

``predict(path, n_tokens, heads)`` gives one path's figure by the names benchmarks/gpu/mixer_check.py times them under
('operator', 'fused', 'triton', 'accumulate', 'sdpa_flash', 'sdpa_cudnn', 'sdpa_efficient'), None where the model
makes no prediction (the einsum path; any backward; a dtype other than bf16 or float16).
"""
from typing import Dict, List, Optional

PEAK_TC = 989e12 * 0.6      # cuBLAS bf16 on skinny shapes
PEAK_FA2, PEAK_CUDNN, PEAK_MEM_EFFICIENT = 320e12, 450e12, 160e12
HBM = 3.35e12
LAUNCH = 5e-6
B, D, K, BYTES = 32, 64, 4, 2


def predictions(n_tokens: int, heads: int, batch: int = B, head_dim: int = D) -> Dict[str, float]:
    """Seconds per forward call of each path."""
    side = int(round((n_tokens - 1) ** 0.5))
    H = W = side
    N, C, B, D = n_tokens, heads * head_dim, batch, head_dim  # noqa: N806 (the docstring's symbols)
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
    hp, wp, bw = -(-H // 16) * 16, -(-W // 16) * 16, max(16, 1 << (W - 1).bit_length())
    triton_flops = 2 * B * heads * K * hp * (hp * wp + bw * wp) * D
    out['triton (one pass)'] = max(triton_flops / PEAK_TC, (K * hp // 16 + 1) * values / HBM) + LAUNCH
    return out


# mixer_check.py's path names -> the table's
PATH_NAMES = {'operator': 'operator (N x N)', 'fused': 'fused (per-head matmuls)', 'triton': 'triton (one pass)',
              'accumulate': 'accumulate', 'sdpa_flash': 'sdpa flash', 'sdpa_cudnn': 'sdpa cudnn',
              'sdpa_efficient': 'sdpa memory-efficient'}


def predict(path: str, n_tokens: int, heads: int, batch: int = B, head_dim: int = D, backward: bool = False,
            dtype: str = 'bfloat16') -> Optional[float]:
    """Predicted seconds of one forward call of ``path`` (a ``PATH_NAMES`` key or the table's name) at ``n_tokens``
    (one prefix token and a square grid), ``heads`` x ``head_dim``, ``batch``; None where the model has no figure:
    the einsum path, a forward+backward (``backward``), a dtype other than the 2-byte bf16 / float16."""
    if backward or dtype not in ('bfloat16', 'float16'):
        return None
    name = PATH_NAMES.get(path, path)
    return predictions(n_tokens, heads, batch, head_dim).get(name)


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
