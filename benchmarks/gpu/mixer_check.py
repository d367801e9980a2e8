"""The SSoG mixer's GPU check (issue 49) in one device call of at most 480 s, sections in this order, each written
to OUT_DIR/summary.md as soon as it finishes (a call cut short keeps what it measured):

1. versions;
2. CUDA against CPU outputs, float32 / bfloat16 / float16 autocast and float16 weights, every family;
3. a kernel profile of one SSoG and one fused-attention forward: CUDA kernels launched, GPU busy time, wall time;
4. timings of SSoG against fused SDPA and the identity floor (ODE, small, 224 and 1024 px, batch 1 and 32,
   inference and training step): eager, eager captured in CUDA graphs, and torch.compile 'reduce-overhead';
5. the mixing paths alone (Triton kernel, N x N operator, accumulate, einsum): agreement and time by grid size;
6. a training-step profile of the 32 px tiny pair at batch 512 (SSoG trained 4x slower than dense there).

    python benchmarks/gpu/mixer_check.py OUT_DIR             # on the GPU machine, from the checkout
    python benchmarks/gpu/mixer_check.py OUT_DIR --dry-run   # every section on the CPU at toy sizes (a test)

``--section NAME`` runs one section alone into ``OUT_DIR/NAME.md`` (exit 1 when it failed): benchmarks/gpu/run.sh
(issue 59) calls each of these in its own subprocess under its own deadline:

- ``gate``: the Triton kernel (``separable_mix(..., use_triton=True)``) and the per-head op against the einsum
  reference in float32, bf16 and float16, plain and transposed, on several grids, prefix counts and batches, forward
  and the gradients of the values and the four factors; writes ``gate.status`` ('pass' or 'fail');
- ``ops``: every mixing path against SDPA with each backend forced, timed with CUDA events, forward and
  forward+backward, over benchmarks/gpu_cost_model.py's prediction where it has one;
- ``sweep``: the Triton kernel's blocks and warps (``TIMM_ODEVIT_TRITON_BI`` / ``_BD`` / ``_WARPS``) at 1024 px;
- ``profile``: torch.profiler tables of one forward and one training step at 1024 px, batch 32, small width.

The Triton rows of ``ops`` and ``sweep`` run only after a ``gate.status`` of 'pass'. On the CPU (``--dry-run``) under
``TRITON_INTERPRET=1`` the Triton kernel runs in Triton's interpreter, through the op's own autograd (a CPU kernel of
the op that takes ``use_triton``, registered for the dry run only); without Triton the gate checks the plain paths
and says so.
"""
import argparse
import csv
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import timm  # noqa: E402
import timm_odevit  # noqa: E402,F401  (registers the models)
from timm_odevit_tools.benchmark.runner import OpCounter  # noqa: E402
from timm_odevit.layers import SeparableGaussianMixer  # noqa: E402
from timm_odevit.layers import fused_mixer  # noqa: E402
from timm_odevit.layers.fused_mixer import (  # noqa: E402
    HAS_TRITON, einsum_mix, kernel_from_log_factors, separable_mix, separable_mix_by_head, separable_mix_triton,
)
from timm_odevit.layers.mixers import _SeparableMixFn, _token_operator_t, gaussian_log_factors  # noqa: E402
from timm_odevit.models.families import FAMILIES, model_name  # noqa: E402

TOTAL_SECONDS = 480


def _median_ms(fn: Callable[[], object], device: str, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        if device == 'cuda':
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == 'cuda':
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def versions(args) -> str:
    import torchdiffeq
    lines = [f'python {sys.version.split()[0]} | torch {torch.__version__} | timm {timm.__version__} | torchdiffeq '
             f'{torchdiffeq.__version__} | triton {"yes" if HAS_TRITON else "missing"}']
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f'gpu {torch.cuda.get_device_name(0)}, {p.total_memory / 2 ** 30:.0f} GiB, '
                     f'cuda {torch.version.cuda}')
    else:
        lines.append('gpu none: a CPU dry run')
    return '\n'.join(lines)


def precision(args) -> str:
    """Relative logit error against float32 on the CPU, same weights, 8 images."""
    rows = ['| model | float32 | bf16 autocast | fp16 autocast | fp16 weights |', '|---|---:|---:|---:|---:|']
    for family in ('ssog_ode', 'odevit') if args.dry_run else FAMILIES:
        torch.manual_seed(0)
        name = model_name(family, 'tiny', small_image=True)
        cpu = timm.create_model(name, num_classes=10).eval()
        x = torch.randn(8, 3, 32, 32)
        with torch.no_grad():
            ref = cpu(x)
            model = timm.create_model(name, num_classes=10).to(args.device).eval()
            model.load_state_dict(cpu.state_dict())
            xd = x.to(args.device)
            outs = [model(xd)]
            for dtype in (torch.bfloat16, torch.float16):
                with torch.autocast(args.device, dtype=dtype):
                    outs.append(model(xd))
            outs.append(model.half()(xd.half()))
        errs = [((o.float().cpu() - ref).norm() / ref.norm()).item() for o in outs]
        rows.append(f'| `{name}` | ' + ' | '.join(f'{e:.2e}' for e in errs) + ' |')
    return '\n'.join(rows)


def kernel_profile(args) -> str:
    """CUDA kernels per inference forward (bf16 autocast, batch 1), their summed time, and the forward's wall time."""
    from torch.profiler import ProfilerActivity, profile
    img = 32 if args.dry_run else 224
    rows = ['| model | px | aten ops | CUDA kernels | GPU busy ms | wall ms | busy / wall |',
            '|---|---:|---:|---:|---:|---:|---:|']
    for name in ('ssog_ode_tiny', 'odevit_tiny') if args.dry_run else (
            'ssog_ode_tiny', 'odevit_tiny', 'ssog_vit_tiny', 'dense_vit_tiny'):
        model = timm.create_model(name, img_size=img).to(args.device).eval()
        x = torch.randn(1, 3, img, img, device=args.device)

        def forward():
            with torch.inference_mode(), torch.autocast(args.device, dtype=torch.bfloat16):
                model(x)
        for _ in range(3):
            forward()
        with OpCounter() as counter:
            forward()
        wall = _median_ms(forward, args.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == 'cuda' else [])
        with profile(activities=activities) as prof:
            forward()
            if args.device == 'cuda':
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1000
        rows.append(f'| `{name}` | {img} | {counter.count} | {len(kernels)} | {busy:.2f} | {wall:.2f} | '
                    f'{busy / wall:.2f} |')
    return '\n'.join(rows)


def timings(args) -> str:
    """The benchmark three ways; each mode writes its own tables under OUT_DIR as each configuration finishes."""
    if args.dry_run:
        common = ['--device', 'cpu', '--resolutions', '32', '--batch-sizes', '1', '--repeats', '1', '--no-memory']
        modes = {'eager': []}  # compiling on the CPU takes minutes: the GPU run's modes are tested apart
    else:
        common = ['--device', 'cuda', '--resolutions', '224', '1024', '--batch-sizes', '1', '32', '--repeats', '5',
                  '--time-budget', '2']
        modes = {'eager': [], 'cudagraphs': ['--cuda-graphs'],
                 'reduce_overhead': ['--compile-mode', 'reduce-overhead', '--no-memory']}
    out = []
    for mode, extra in modes.items():
        prefix = f'timings_{mode}'
        cmd = [sys.executable, '-m', 'timm_odevit_tools.benchmark', '--settings', 'ode', '--widths',
               'tiny' if args.dry_run else 'small', '--variants', 'ssog', 'fused', 'floor', '--precision',
               'amp_bfloat16', '--out-dir', str(args.out), '--prefix', prefix] + common + extra
        limit = 40 if args.dry_run else 110
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
            status = f'exit {proc.returncode}' + ('' if proc.returncode == 0 else f': {proc.stderr[-500:]}')
        except subprocess.TimeoutExpired:
            status = f'cut at {limit} s (the finished configurations are in {prefix}.csv)'
        md = args.out / f'{prefix}.md'
        table = md.read_text().split('\n\n')[1] if md.exists() else '(nothing measured)'
        out.append(f'### {mode} ({status})\n\n{table}')
    return '\n\n'.join(out)


def mixing_paths(args) -> str:
    """One mixer (small width: 384, 6 heads, 4 components) on each path, bf16 autocast, inference: agreement with the
    einsum reference and median ms per call, by grid and batch."""
    grids = [(4, 4), (8, 8)] if args.dry_run else [(14, 14), (24, 24), (32, 32), (64, 64)]
    batches = [1, 2] if args.dry_run else [1, 32]
    # fused: the per-head matmuls; triton: the one-pass kernel (CUDA with Triton; its default waits on this table)
    paths = ['operator', 'accumulate', 'einsum', 'fused'] + (['triton'] if args.device == 'cuda' and HAS_TRITON else [])
    rows = ['| grid | batch | ' + ' | '.join(f'{p} ms' for p in paths) + ' | max rel. error |',
            '|---|---:|' + '---:|' * (len(paths) + 1)]
    torch.manual_seed(0)
    for grid in grids:
        for batch in batches:
            mixers = {p: SeparableGaussianMixer(384, 6, mixing=p).to(args.device).eval() for p in paths}
            for m in mixers.values():
                m.load_state_dict(mixers['einsum'].state_dict())
            x = torch.randn(batch, 1 + grid[0] * grid[1], 384, device=args.device)
            times, outs = {}, {}
            for p, m in mixers.items():
                with torch.inference_mode(), torch.autocast(args.device, dtype=torch.bfloat16):
                    outs[p] = m(x, grid).float()
                    times[p] = _median_ms(lambda: m(x, grid), args.device, 3 if args.dry_run else 10)
            ref = outs['einsum']
            err = max(((o - ref).norm() / ref.norm()).item() for o in outs.values())
            rows.append(f'| {grid[0]}x{grid[1]} | {batch} | ' + ' | '.join(f'{times[p]:.3f}' for p in paths)
                        + f' | {err:.1e} |')
    return '\n'.join(rows)


def training_profile(args) -> str:
    """One training step of the 32 px tiny pair at batch 512 (bf16 autocast): images/s and the ten CUDA kernels (CPU
    ops in a dry run) that take the most time."""
    from torch.profiler import ProfilerActivity, profile
    batch = 16 if args.dry_run else 512
    out = []
    for family in ('ssog_vit', 'dense_vit'):
        name = model_name(family, 'tiny', small_image=True)
        model = timm.create_model(name, num_classes=10, in_chans=1).to(args.device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, 1, 32, 32, device=args.device)
        y = torch.randint(0, 10, (batch,), device=args.device)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
        for _ in range(3):
            step()
        ms = _median_ms(step, args.device, 3 if args.dry_run else 10)
        cuda = args.device == 'cuda'
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by='cuda_time_total' if cuda else 'cpu_time_total', row_limit=10)
        out.append(f'### `{name}`, batch {batch}: {batch / ms * 1000:.0f} images/s ({ms:.1f} ms per step)\n\n'
                   f'```\n{table}\n```')
    return '\n\n'.join(out)


# ---- issue 59: the sections benchmarks/gpu/run.sh runs one per subprocess (``--section``) ----

def _interpreted() -> bool:
    """Triton's interpreter is on (a CPU dry run): the kernel was defined for it at import."""
    return os.environ.get('TRITON_INTERPRET') == '1'


def triton_runs(device: str) -> bool:
    """Whether the Triton kernel can run here: CUDA with Triton, or the CPU under Triton's interpreter."""
    return HAS_TRITON and (device == 'cuda' or _interpreted())


_ROUTED = []


def route_triton_on_cpu() -> None:
    """A CPU kernel of ``separable_mix`` that honours ``use_triton`` by launching the kernel in Triton's interpreter:
    the dry run then takes the CUDA code path (the op, its autograd, the kernel) on the CPU. Dry runs only."""
    if _ROUTED or not (HAS_TRITON and _interpreted()):
        return

    @separable_mix.register_kernel('cpu')
    def _cpu(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose=False, use_triton=False):
        fn = separable_mix_triton if use_triton else separable_mix_by_head
        return fn(v, band_y, rows_y, band_x, rows_x, height, width, mean_prefix, transpose)
    _ROUTED.append(_cpu)


def gate_passed(out: Path) -> bool:
    """The gate section's verdict, as it left it in ``gate.status``; False when it did not finish."""
    status = out / 'gate.status'
    return status.is_file() and status.read_text().strip() == 'pass'


# (forward, gradients) relative error allowed against the float32 einsum reference: float32 runs IEEE dots; the
# half types round the kernels, the values and the output to 8 (bf16) or 11 (float16) bits
GATE_TOLERANCE = {'float32': (1e-4, 1e-3), 'float16': (5e-3, 2e-2), 'bfloat16': (4e-2, 1e-1)}
GATE_GRADS = ('v', 'band_y', 'rows_y', 'band_x', 'rows_x')


def _factors(heads: int, K: int, H: int, W: int, device: str, seed: int) -> List[torch.Tensor]:
    """Random log-Toeplitz factors (band_y, rows_y, band_x, rows_x) as a model makes them: Gaussians of widths 0.5
    to 8 patches, centres off by up to 2, G^y weighted by a mixture; float32 leaves."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.exp(torch.empty(2, heads, K).uniform_(math.log(0.5), math.log(8.), generator=g))
    offset = torch.empty(2, heads, K).uniform_(-2., 2., generator=g)
    log_mix = torch.randn(heads, K, generator=g).log_softmax(-1)
    band_y, rows_y = gaussian_log_factors(H, sigma[0], offset[0])
    band_x, rows_x = gaussian_log_factors(W, sigma[1], offset[1])
    return [t.to(device).requires_grad_() for t in (band_y, rows_y + log_mix[..., None], band_x, rows_x)]


def reference_mix(v: torch.Tensor, band_y: torch.Tensor, rows_y: torch.Tensor, band_x: torch.Tensor,
                  rows_x: torch.Tensor, height: int, width: int, transpose: bool) -> torch.Tensor:
    """The op by ``einsum_mix`` (the mixer's einsum path), prefix tokens receiving the patch mean: the reference."""
    B, N, C = v.shape
    heads, P = band_y.shape[0], N - height * width
    gy, gx = kernel_from_log_factors(band_y, rows_y, transpose), kernel_from_log_factors(band_x, rows_x, transpose)
    y = einsum_mix(v[:, P:].reshape(B, height, width, heads, C // heads), gx, gy).reshape(B, height * width, C)
    return torch.cat([v[:, P:].mean(dim=1, keepdim=True).expand(B, P, C), y], dim=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def gate_case(path: str, dtype: torch.dtype, transpose: bool, grid: Tuple[int, int], prefix: int, batch: int,
              heads: int, head_dim: int, device: str, seed: int = 0) -> Tuple[float, Dict[str, float]]:
    """One case: ``path`` ('triton' or 'per-head') against the float32 einsum reference from the same (rounded)
    values and factors; (forward error, {input: gradient error}) as relative norms."""
    H, W = grid
    C, K = heads * head_dim, 4
    # made on the device (100 MB at 64 x 64, batch 32: the CPU's generator would take longer than the case)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(batch, prefix + H * W, C, generator=g, device=device)
    upstream = torch.randn(batch, prefix + H * W, C, generator=g, device=device)
    key = (dtype, transpose, grid, prefix, batch, heads, head_dim, device, seed)
    outs, grads = [], []
    for candidate in (True, False):
        if not candidate and _REFERENCE.get('key') == key:  # the same case for the other path: reused
            outs.append(_REFERENCE['out'])
            grads.append(_REFERENCE['grads'])
            continue
        factors = _factors(heads, K, H, W, device, seed)
        # a fresh leaf each (float32's .to and .float return the tensor itself: its .grad would be shared)
        v = (x.to(dtype) if candidate else x.to(dtype).float()).clone().requires_grad_()
        if candidate:
            out = separable_mix(v, *factors, H, W, True, transpose, use_triton=path == 'triton')
        else:
            out = reference_mix(v, *factors, H, W, transpose)
        (out.float() * upstream).sum().backward()
        outs.append(out.detach().float())
        grads.append([v.grad.float()] + [f.grad for f in factors])
        if not candidate:
            _REFERENCE.clear()
            _REFERENCE.update(key=key, out=outs[-1], grads=grads[-1])
    return _rel(*outs), {name: _rel(a, b) for name, a, b in zip(GATE_GRADS, *grads)}


_REFERENCE: Dict[str, object] = {}  # the last case's reference, kept for its other path


def gate(args: argparse.Namespace) -> str:
    """The correctness gate: every case of GATE_TOLERANCE's dtypes x plain/transposed x grids x prefix counts x
    batches, for the Triton kernel and the per-head op. Writes the full table to gate_cases.md, ``gate.status``, and
    returns the summary by dtype and path (the table summary.md opens with); raises when a case fails."""
    if args.device == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    (args.out / 'gate.status').write_text('running\n')
    if args.dry_run:
        grids, prefixes, batches, heads, head_dim = [(5, 3)], [0, 1, 11], [1, 2], 2, 8
    else:
        grids, prefixes, batches, heads, head_dim = [(14, 14), (20, 18), (64, 64)], [0, 1, 11], [1, 32], 3, 64
    route_triton_on_cpu()
    paths = ['per-head'] + (['triton'] if triton_runs(args.device) else [])
    note = '' if 'triton' in paths else (
        '\n\nThe Triton kernel cannot run here (no CUDA, and Triton is missing or TRITON_INTERPRET is not 1): the '
        "gate's harness ran against the plain per-head path only.")
    rows = ['| dtype | transposed | grid | prefix | batch | path | forward error | worst gradient error | ok |',
            '|---|---|---|---:|---:|---|---:|---:|---|']
    summary: Dict[Tuple[str, str, bool], List] = {}
    failures = []
    for dname, (ftol, gtol) in GATE_TOLERANCE.items():
        dtype = getattr(torch, dname)
        for transpose in (False, True):
            for grid in grids:
                for prefix in prefixes:
                    for batch in batches:
                        for path in paths:
                            fwd, grads = gate_case(path, dtype, transpose, grid, prefix, batch, heads, head_dim,
                                                   args.device)
                            worst = max(grads, key=grads.get)
                            ok = fwd <= ftol and grads[worst] <= gtol and all(map(math.isfinite, grads.values()))
                            label = f'{dname} {"T" if transpose else "plain"} {grid[0]}x{grid[1]} P{prefix} B{batch}'
                            if not ok:
                                failures.append(f'{path} {label}: forward {fwd:.1e}, d{worst} {grads[worst]:.1e}')
                            rows.append(f'| {dname} | {"yes" if transpose else "no"} | {grid[0]}x{grid[1]} | '
                                        f'{prefix} | {batch} | {path} | {fwd:.1e} | {grads[worst]:.1e} (d{worst}) | '
                                        f'{"yes" if ok else "**NO**"} |')
                            print(rows[-1], flush=True)  # a gate cut at its deadline leaves these in its log
                            s = summary.setdefault((dname, path, transpose), [0, 0, 0., 0., ftol, gtol])
                            s[0] += 1
                            s[1] += ok
                            s[2], s[3] = max(s[2], fwd), max(s[3], grads[worst])
    (args.out / 'gate_cases.md').write_text('\n'.join(rows) + '\n')
    passed = not failures
    (args.out / 'gate.status').write_text('pass\n' if passed else 'fail\n')
    table = ['| dtype | path | transposed | cases passed | worst forward error | worst gradient error | tolerance '
             '(forward / gradients) |', '|---|---|---|---:|---:|---:|---|']
    for (dname, path, transpose), (n, ok, fwd, grd, ftol, gtol) in summary.items():
        table.append(f'| {dname} | {path} | {"yes" if transpose else "no"} | {ok} / {n} | {fwd:.1e} | {grd:.1e} | '
                     f'{ftol:.0e} / {gtol:.0e} |')
    shapes = (f'grids {", ".join(f"{h}x{w}" for h, w in grids)}; prefix tokens {prefixes}; batch {batches}; '
              f'{heads} heads of {head_dim}; K = 4; forward and the gradients of the values and the four factors '
              f'(every case: gate_cases.md)')
    verdict = 'GATE PASSED' if passed else f'GATE FAILED ({len(failures)} cases): the Triton timings are skipped'
    text = f'**{verdict}** on {args.device}: {shapes}.{note}\n\n' + '\n'.join(table)
    if failures:
        text += '\n\nFailed cases:\n\n' + '\n'.join(f'- {f}' for f in failures[:40])
        raise SectionFailed(text)
    return text


class SectionFailed(Exception):
    """A section that ran to its end and found a failure: its text is still the section's report."""


def _cost_model():
    spec = importlib.util.spec_from_file_location('gpu_cost_model', ROOT / 'benchmarks' / 'gpu_cost_model.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_ms(fn: Callable[[], object], device: str, warmup: int = 2, repeats: int = 10) -> float:
    """Median ms of ``fn``: CUDA events around each call on the GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == 'cuda':
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


OP_PATHS = ('operator', 'fused', 'triton', 'accumulate', 'einsum')
SDPA_BACKENDS = {'sdpa_flash': 'FLASH_ATTENTION', 'sdpa_cudnn': 'CUDNN_ATTENTION',
                 'sdpa_efficient': 'EFFICIENT_ATTENTION'}


def op_call(path: str, batch: int, n_tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: str,
            backward: bool) -> Callable[[], None]:
    """One call of the mixing op on ``path`` (or SDPA with a forced backend), inputs made once: a forward without
    autograd, or a forward and its backward to every input that a training step differentiates."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    side = int(round((n_tokens - 1) ** 0.5))
    H = W = side
    P, C = n_tokens - H * W, heads * head_dim
    torch.manual_seed(0)

    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt).requires_grad_(backward)
    factors = [f.detach().requires_grad_(backward) for f in _factors(heads, 4, H, W, device, 0)]
    kernels = [kernel_from_log_factors(*factors[i:i + 2]).detach().to(dtype).requires_grad_(backward) for i in (2, 0)]
    if path.startswith('sdpa'):
        q, k, v = (leaf(batch, heads, n_tokens, head_dim) for _ in range(3))
        backend = getattr(SDPBackend, SDPA_BACKENDS[path])

        def forward():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        inputs = [q, k, v]
    elif path in ('fused', 'triton'):
        v = leaf(batch, n_tokens, C)
        inputs = [v] + factors

        def forward():
            return separable_mix(v, *factors, H, W, True, False, use_triton=path == 'triton')
    elif path == 'operator':
        gx, gy = kernels
        mix = torch.ones(heads, 4, device=device)  # G^y is weighted already
        op_t = _token_operator_t(gy.detach().float(), gx.detach().float(), mix, P, True).to(dtype)
        op_t.requires_grad_(backward)
        vt = leaf(heads, head_dim * batch, n_tokens)
        inputs = [vt, op_t]

        def forward():
            return torch.bmm(vt, op_t)
    elif path == 'accumulate':
        gx, gy = kernels
        x, weight = leaf(batch, n_tokens, C, dt=dtype).detach(), torch.randn(C, C, device=device, dtype=dtype)
        p = leaf(heads, H, batch * head_dim, W)
        inputs = [p, gx, gy]

        def forward():
            return _SeparableMixFn.apply(p, gx, gy, x, weight, None, P, H, W)
    elif path == 'einsum':
        gx, gy = kernels
        vp = leaf(batch, H, W, heads, head_dim)
        inputs = [vp, gx, gy]

        def forward():
            return einsum_mix(vp, gx, gy)
    else:
        raise ValueError(path)
    if not backward:
        def call():
            with torch.no_grad():
                forward()
        return call
    grad = None

    def call():
        nonlocal grad
        for t in inputs:
            t.grad = None
        out = forward()
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
    return call


def ops(args: argparse.Namespace) -> str:
    """Every mixing path and SDPA with each backend forced, ms per call by CUDA events (forward; forward+backward),
    with measured / predicted where benchmarks/gpu_cost_model.py predicts. Rows also go to ops.csv."""
    model = _cost_model()
    if args.dry_run:
        batch, tokens, heads_list, head_dim, repeats = 2, [17, 26], [3], 8, 1
    else:
        batch, tokens, heads_list, head_dim, repeats = 32, [197, 1025, 4097], [3, 6], 64, 10
    route_triton_on_cpu()
    gated = gate_passed(args.out)
    paths = [p for p in OP_PATHS if p != 'triton' or (triton_runs(args.device) and gated)] + list(SDPA_BACKENDS)
    notes = []
    if not gated:
        notes.append('Triton rows skipped: the gate did not pass (gate.status).')
    elif 'triton' not in paths:
        notes.append('Triton rows skipped: the kernel cannot run here.')
    header = ['dtype', 'pass', 'N', 'heads'] + list(paths)
    rows = ['| ' + ' | '.join(header) + ' |', '|---|---|---:|---:|' + '---:|' * len(paths)]
    records, errors = [], []
    for dname in ('bfloat16', 'float16'):
        dtype = getattr(torch, dname)
        for backward in (False, True):
            for n in tokens:
                for heads in heads_list:
                    cells = []
                    for path in paths:
                        try:
                            ms = time_ms(op_call(path, batch, n, heads, head_dim, dtype, args.device, backward),
                                         args.device, warmup=0 if args.dry_run else 2, repeats=repeats)
                        except Exception as e:  # noqa: BLE001 -- a backend that cannot take the shape is a finding
                            msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
                            if not path.startswith('sdpa'):
                                errors.append(f'{path} {dname} N={n} heads={heads}: {msg}')
                            cells.append('n/a')
                            records.append(dict(dtype=dname, backward=int(backward), n_tokens=n, heads=heads,
                                                path=path, ms='', predicted_ms='', error=msg))
                            continue
                        pred = model.predict(path, n, heads, batch=batch, head_dim=head_dim, backward=backward,
                                             dtype=dname)
                        cells.append(f'{ms:.3f}' + (f' ({ms / (pred * 1e3):.2f}x)' if pred else ''))
                        records.append(dict(dtype=dname, backward=int(backward), n_tokens=n, heads=heads, path=path,
                                            ms=f'{ms:.4f}', predicted_ms=f'{pred * 1e3:.4f}' if pred else '',
                                            error=''))
                        if args.device == 'cuda':
                            torch.cuda.empty_cache()
                    rows.append(f'| {dname} | {"fwd+bwd" if backward else "fwd"} | {n} | {heads} | '
                                + ' | '.join(cells) + ' |')
                    print(rows[-1], flush=True)
    with (args.out / 'ops.csv').open('w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    text = (f'ms per call, batch {batch}, head dim {head_dim}, {args.device}'
            + (' (CUDA events)' if args.device == 'cuda' else ' (wall clock)')
            + '; in brackets measured / predicted (benchmarks/gpu_cost_model.py: forward, 2-byte types). '
            'SSoG paths: the mixing alone from the values (kernels built; factor gradients in fwd+bwd); SDPA: '
            'q, k, v in, its backend forced (n/a: unavailable for the shape).\n\n' + '\n'.join(rows))
    if notes:
        text += '\n\n' + '\n'.join(notes)
    if errors:
        raise SectionFailed(text + '\n\nSSoG paths that failed:\n\n' + '\n'.join(f'- {e}' for e in errors))
    return text


SWEEP_ENV = ('TIMM_ODEVIT_TRITON_BI', 'TIMM_ODEVIT_TRITON_BD', 'TIMM_ODEVIT_TRITON_WARPS')


def sweep(args: argparse.Namespace) -> str:
    """The Triton kernel's output rows per block (BI), channels per block (BD) and warps at 1024 px (64 x 64 patches
    and a CLS token), batch 32, small width (6 heads of 64), bf16: forward and forward+backward ms per config."""
    route_triton_on_cpu()
    if not gate_passed(args.out):
        return 'skipped: the gate did not pass (gate.status), so no Triton timing runs.'
    if not triton_runs(args.device):
        return 'skipped: the Triton kernel cannot run here.'
    if args.dry_run:
        batch, n, heads, head_dim, repeats = 2, 17, 2, 8, 1
        others = [(8, 16, 2)]
    else:
        batch, n, heads, head_dim, repeats = 32, 4097, 6, 64, 5
        # one or two changes from the default at a time; a block holds BI x 64 x BD float32 accumulators over
        # 32 x warps threads, so the larger blocks may spill or fail to compile (a row of errors, not a failure)
        others = [(16, 32, 8), (8, 32, 8), (32, 16, 8), (8, 64, 8), (16, 16, 4), (16, 64, 16)]
    for key in SWEEP_ENV:  # the default as the kernel's dispatcher has it today, measured first
        os.environ.pop(key, None)
    default = fused_mixer.triton_launch_config(int(round((n - 1) ** 0.5)), head_dim, torch.bfloat16)
    default = (default['BI'], default['BD'], default['num_warps'])
    configs = [default] + [c for c in others if c != default]
    rows = ['| BI | BD | warps | forward ms | fwd+bwd ms |', '|---:|---:|---:|---:|---:|']
    errors = 0
    for bi, bd, warps in configs:
        os.environ.update(dict(zip(SWEEP_ENV, map(str, (bi, bd, warps)))))
        cells = []
        for backward in (False, True):
            try:
                call = op_call('triton', batch, n, heads, head_dim, torch.bfloat16, args.device, backward)
                cells.append(f'{time_ms(call, args.device, warmup=0 if args.dry_run else 1, repeats=repeats):.3f}')
            except Exception as e:  # noqa: BLE001 -- a config that does not compile (registers, shared memory)
                errors += 1
                cells.append('error: ' + (str(e).strip().splitlines() or [type(e).__name__])[0][:80])
        mark = ' (default)' if (bi, bd, warps) == default else ''
        rows.append(f'| {bi} | {bd} | {warps}{mark} | ' + ' | '.join(cells) + ' |')
        print(rows[-1], flush=True)
    for key in SWEEP_ENV:
        os.environ.pop(key, None)
    text = f'batch {batch}, N = {n}, {heads} heads of {head_dim}, bf16, {args.device}\n\n' + '\n'.join(rows)
    if errors == 2 * len(configs):
        raise SectionFailed(text + '\n\nNo configuration ran.')
    return text


def profile(args: argparse.Namespace) -> str:
    """torch.profiler of one inference forward and one training step (AdamW, bf16 autocast) of the small SSoG ODE
    model at 1024 px, batch 32 (tiny, 32 px, batch 2 in a dry run); the full tables go to profile.txt."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    width, img, batch = ('tiny', 32, 2) if args.dry_run else ('small', 1024, 32)
    name = model_name('ssog_ode', width)
    model = timm.create_model(name, img_size=img).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, img, img, device=args.device)
    y = torch.randint(0, model.num_classes, (batch,), device=args.device)

    def forward():
        model.eval()
        with torch.inference_mode(), torch.autocast(args.device, dtype=torch.bfloat16):
            model(x)

    def step():
        model.train()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
    cuda = args.device == 'cuda'
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = 'cuda_time_total' if cuda else 'cpu_time_total'
    full, out = [], []
    for label, fn in (('forward', forward), ('training step', step)):
        fn()  # warm-up: lazy initialisation, cuBLAS workspaces, Triton compiles
        if cuda:
            torch.cuda.synchronize()
        with torch_profile(activities=activities) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        averages = prof.key_averages()
        full.append(f'# {name} at {img} px, batch {batch}, bf16 autocast: {label}\n\n'
                    f'{averages.table(sort_by=sort, row_limit=40)}\n')
        out.append(f'### {label}\n\n```\n{averages.table(sort_by=sort, row_limit=8)}\n```')
    (args.out / 'profile.txt').write_text('\n'.join(full))
    return f'`{name}`, {img} px, batch {batch}, bf16 autocast ({args.device}); 40 rows each in profile.txt\n\n' + \
        '\n\n'.join(out)


RUN_SECTIONS: Dict[str, Callable] = {'gate': gate, 'ops': ops, 'sweep': sweep, 'profile': profile}


def run_one(args: argparse.Namespace) -> int:
    """``--section``: one section into OUT_DIR/<section>.md; 0 when it passed, 1 when it failed."""
    t0 = time.time()
    rc = 0
    try:
        text = RUN_SECTIONS[args.section](args)
    except SectionFailed as e:
        text, rc = str(e), 1
    except Exception:  # noqa: BLE001 -- reported in the section's file, then the exit status says it failed
        text, rc = f'failed:\n\n```\n{traceback.format_exc()[-3000:]}\n```', 1
    text += f'\n\n({time.time() - t0:.0f} s)'
    (args.out / f'{args.section}.md').write_text(text + '\n')
    print(text, flush=True)
    return rc


SECTIONS: Dict[str, Callable] = {
    # agreement first: a path that disagrees with the reference is not worth timing
    'versions': versions, 'precision: CUDA against CPU': precision, 'mixing paths': mixing_paths,
    'kernel profile': kernel_profile, 'timings: eager, CUDA graphs, reduce-overhead': timings,
    'training-step profile': training_profile,
}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('out', type=Path)
    p.add_argument('--dry-run', action='store_true', help='every section on the CPU at toy sizes')
    p.add_argument('--section', choices=list(RUN_SECTIONS), default=None,
                   help="one of benchmarks/gpu/run.sh's sections alone, into OUT_DIR/<section>.md")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.device = 'cpu' if args.dry_run or not torch.cuda.is_available() else 'cuda'
    if args.section:
        return run_one(args)
    summary = args.out / 'summary.md'
    summary.write_text(f'# SSoG mixer GPU check ({time.strftime("%Y-%m-%d %H:%M")}, {args.device})\n')
    start, failed = time.time(), 0
    for title, section in SECTIONS.items():
        if time.time() - start > TOTAL_SECONDS:
            text, failed = f'skipped: the {TOTAL_SECONDS} s of the call are spent', failed + 1
        else:
            t0 = time.time()
            try:
                text = section(args)
            except Exception:  # noqa: BLE001 -- one section's failure must not lose the others
                text, failed = f'failed:\n\n```\n{traceback.format_exc()[-3000:]}\n```', failed + 1
            text += f'\n\n({time.time() - t0:.0f} s)'
        with summary.open('a') as f:
            f.write(f'\n## {title}\n\n{text}\n')
        print(f'## {title}\n{text}\n', flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
