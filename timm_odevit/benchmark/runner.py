"""Side-by-side cost of the SSoG mixer, fused dense attention and an identity mixer (the floor) across resolutions.

For each depth setting and width, three models that differ only in the token mixer are timed interleaved
(A B C A B C ...) at one batch size per resolution; medians and spread are reported, warm-up excluded. Peak memory is
measured per configuration: on CUDA with ``torch.cuda.max_memory_allocated``, on CPU as the peak resident memory of a
fresh child process minus its baseline after the model and input are built.
"""
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import timm
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from .. import models  # noqa: F401  (registers the models)

SETTINGS = {
    'discrete': ('ssog_vit', 'dense_vit'),
    'looped': ('looped_ssog', 'looped_vit'),
    'ode': ('ssog_ode', 'odevit'),
}
VARIANTS = ('ssog', 'dense', 'floor')
WIDTHS = ('tiny', 'small', 'base')
# timm's benchmark.py column names where they exist, then ours
CSV_COLUMNS = [
    'model', 'setting', 'width', 'variant', 'status',
    'infer_samples_per_sec', 'infer_step_time', 'infer_step_time_min', 'infer_step_time_max', 'infer_batch_size',
    'infer_img_size', 'infer_gmacs', 'infer_mem_mb',
    'train_samples_per_sec', 'train_step_time', 'train_step_time_min', 'train_step_time_max', 'train_batch_size',
    'train_img_size', 'train_mem_mb',
    'param_count', 'nfe', 'device',
]


class BenchmarkConfigError(ValueError):
    """A configuration the benchmark cannot run (unknown model, resolution not divisible by the patch)."""


@dataclass
class Case:
    """One model at one resolution: the SSoG model, its dense twin or its floor twin."""
    setting: str
    width: str
    variant: str
    img_size: int
    batch_size: int

    @property
    def model_name(self) -> str:
        ssog, dense = SETTINGS[self.setting]
        return f'{dense if self.variant == "dense" else ssog}_{self.width}'

    @property
    def label(self) -> str:
        return f'{self.model_name}{"+identity" if self.variant == "floor" else ""}@{self.img_size}'

    def build(self, device: str = 'cpu', dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        kwargs = dict(img_size=self.img_size, device=device, dtype=dtype)
        if self.variant == 'floor':
            kwargs['mixer'] = 'identity'
        return timm.create_model(self.model_name, **kwargs)


@dataclass
class Result:
    case: Case
    status: str = 'ok'
    infer_times: List[float] = field(default_factory=list)
    train_times: List[float] = field(default_factory=list)
    gmacs: Optional[float] = None
    params: Optional[int] = None
    nfe: Optional[int] = None
    infer_mem_mb: Optional[float] = None
    train_mem_mb: Optional[float] = None

    def row(self, device: str) -> Dict[str, object]:
        c = self.case

        def stats(times: List[float], prefix: str) -> Dict[str, object]:
            if not times:
                return {}
            med = statistics.median(times)
            return {
                f'{prefix}_samples_per_sec': round(c.batch_size / med, 3),
                f'{prefix}_step_time': round(1000 * med, 3),
                f'{prefix}_step_time_min': round(1000 * min(times), 3),
                f'{prefix}_step_time_max': round(1000 * max(times), 3),
            }

        row = dict(model=c.label, setting=c.setting, width=c.width, variant=c.variant, status=self.status,
                   infer_batch_size=c.batch_size, infer_img_size=c.img_size,
                   train_batch_size=c.batch_size, train_img_size=c.img_size,
                   device=device, param_count=round(self.params / 1e6, 3) if self.params else None,
                   infer_gmacs=round(self.gmacs, 3) if self.gmacs is not None else None, nfe=self.nfe,
                   infer_mem_mb=_round(self.infer_mem_mb), train_mem_mb=_round(self.train_mem_mb))
        row.update(stats(self.infer_times, 'infer'))
        row.update(stats(self.train_times, 'train'))
        return row


def _round(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 1)


def validate(settings: Sequence[str], widths: Sequence[str], resolutions: Sequence[int]) -> None:
    """Fail before any work on names or sizes the run cannot use."""
    for s in settings:
        if s not in SETTINGS:
            raise BenchmarkConfigError(f'Unknown depth setting {s!r}; choose from {list(SETTINGS)}.')
    registered = set(timm.list_models())
    for s in settings:
        for w in widths:
            for name in SETTINGS[s]:
                if f'{name}_{w}' not in registered:
                    raise BenchmarkConfigError(
                        f'Unknown model {name}_{w!s}: width {w!r} is not one of {list(WIDTHS)}.')
    for r in resolutions:
        if r <= 0 or r % 16:
            raise BenchmarkConfigError(
                f'Resolution {r} is not divisible by the patch size 16; use a multiple of 16 '
                f'(e.g. {16 * max(1, r // 16)}).')


def is_oom(e: BaseException) -> bool:
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and ('out of memory' in str(e) or "can't allocate memory" in str(e))


def _sync(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def make_steps(model: torch.nn.Module, case: Case, device: str, dtype: torch.dtype) -> Tuple[Callable, Callable]:
    """(inference step, training step) closures over one fixed input batch."""
    x = torch.randn(case.batch_size, 3, case.img_size, case.img_size, device=device, dtype=dtype)
    target = torch.randint(0, 1000, (case.batch_size,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    loss_fn = torch.nn.CrossEntropyLoss()

    def infer() -> None:
        model.eval()
        with torch.inference_mode():
            model(x)

    def train() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x).float(), target).backward()
        opt.step()

    return infer, train


def count_gmacs(
        model: torch.nn.Module,
        img_size: int,
        device: str = 'cpu',
        dtype: torch.dtype = torch.float32,
) -> float:
    """Multiply-accumulates of one image's forward pass, in billions."""
    x = torch.randn(1, model.in_chans, img_size, img_size, device=device, dtype=dtype)
    model.eval()
    # the math backend: the fused CPU attention kernel has no flop formula and would count as zero
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() / 2e9


def time_interleaved(
        cases: Sequence[Case],
        repeats: int,
        warmup: int,
        device: str,
        dtype: torch.dtype,
        do_train: bool = True,
        progress: Optional[Callable[[str], None]] = None,
) -> List[Result]:
    """Build every case, then time inference and training steps A B C A B C ...; OOM marks a case, others go on."""
    results = [Result(c) for c in cases]
    steps: List[Optional[Tuple[Callable, Callable]]] = []
    models_: List[Optional[torch.nn.Module]] = []
    for r in results:
        try:
            model = r.case.build(device, dtype)
            r.params = sum(p.numel() for p in model.parameters())
            r.gmacs = count_gmacs(model, r.case.img_size, device, dtype)
            r.nfe = model.nfe
            steps.append(make_steps(model, r.case, device, dtype))
            models_.append(model)
        except Exception as e:  # noqa: BLE001 -- an OOM is a result, anything else is re-raised
            if not is_oom(e):
                raise
            r.status = 'OOM'
            steps.append(None)
            models_.append(None)
    for kind in ('infer', 'train') if do_train else ('infer',):
        for rep in range(warmup + repeats):
            for r, st in zip(results, steps):
                if st is None or r.status != 'ok':
                    continue
                fn = st[0] if kind == 'infer' else st[1]
                try:
                    _sync(device)
                    start = time.perf_counter()
                    fn()
                    _sync(device)
                    elapsed = time.perf_counter() - start
                except Exception as e:  # noqa: BLE001
                    if not is_oom(e):
                        raise
                    r.status = 'OOM'
                    continue
                if rep >= warmup:
                    (r.infer_times if kind == 'infer' else r.train_times).append(elapsed)
            if progress:
                progress(f'{kind} repeat {rep + 1}/{warmup + repeats}')
    del models_, steps
    return results


# ---- peak memory


def _rss_kb(key: str) -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'{key} not in /proc/self/status')


def _reset_peak_rss() -> None:
    # writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS (Linux >= 4.0)
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')


def measure_memory_in_process(case: Case, device: str, dtype: torch.dtype, do_train: bool = True) -> Dict[str, float]:
    """Peak memory above the baseline (model and input built) of one inference step and one training step, in MB.

    Meant to run in a fresh process (``child_main``) on CPU, so earlier allocations do not hide in the peak."""
    model = case.build(device, dtype)
    infer, train = make_steps(model, case, device, dtype)
    out = {}
    for kind, fn in (('infer', infer), ('train', train)) if do_train else (('infer', infer),):
        if device.startswith('cuda'):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            out[kind] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        else:
            base = _rss_kb('VmRSS')
            _reset_peak_rss()
            fn()
            out[kind] = (_rss_kb('VmHWM') - base) / 1024
    return out


def measure_memory(case: Case, device: str, dtype: torch.dtype, do_train: bool = True,
                   timeout: float = 1800.) -> Tuple[str, Dict[str, float]]:
    """Peak memory of one case: in a fresh child process on CPU, in this process on CUDA. ('ok' | 'OOM', MB)."""
    if device.startswith('cuda'):
        try:
            return 'ok', measure_memory_in_process(case, device, dtype, do_train)
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            torch.cuda.empty_cache()
            return 'OOM', {}
    cmd = [sys.executable, '-m', 'timm_odevit.benchmark.runner', json.dumps(dict(
        case=asdict(case), device=device, dtype=str(dtype).replace('torch.', ''), train=do_train))]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode == 0:
        return 'ok', json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode in (-9, 137) or 'OOM' in proc.stdout or "can't allocate memory" in proc.stderr:
        return 'OOM', {}
    raise RuntimeError(f'memory child for {case.label} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}')


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    torch.set_num_threads(int(os.environ.get('OMP_NUM_THREADS', torch.get_num_threads())))
    case = Case(**spec['case'])
    try:
        out = measure_memory_in_process(case, spec['device'], getattr(torch, spec['dtype']), spec['train'])
    except Exception as e:  # noqa: BLE001
        if is_oom(e):
            print('OOM')
            sys.exit(3)
        raise
    print(json.dumps(out))


# ---- reports


def write_csv(rows: Iterable[Dict[str, object]], path: str) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in CSV_COLUMNS})


def ratio_rows(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per (setting, width, resolution): SSoG vs dense throughput and memory, and SSoG cost over the floor."""
    index = {(r['setting'], r['width'], int(r['infer_img_size']), r['variant']): r for r in rows}
    out = []
    keys = sorted({(s, w, i) for s, w, i, _ in index}, key=lambda k: (list(SETTINGS).index(k[0]), k[1], k[2]))
    for s, w, img in keys:
        ssog, dense, floor = (index.get((s, w, img, v)) for v in VARIANTS)
        out.append(dict(
            setting=s, width=w, img_size=img,
            infer_speedup=_ratio(ssog, dense, 'infer_samples_per_sec'),
            train_speedup=_ratio(ssog, dense, 'train_samples_per_sec'),
            infer_mem_saving=_saving(ssog, dense, 'infer_mem_mb'),
            train_mem_saving=_saving(ssog, dense, 'train_mem_mb'),
            infer_cost_over_floor=_ratio(floor, ssog, 'infer_samples_per_sec'),
            train_cost_over_floor=_ratio(floor, ssog, 'train_samples_per_sec'),
        ))
    return out


def _ratio(a: Optional[Dict], b: Optional[Dict], key: str) -> Optional[float]:
    """a[key] / b[key] (None when either side is missing or OOM)."""
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return float(a[key]) / float(b[key])


def _saving(a: Optional[Dict], b: Optional[Dict], key: str) -> Optional[float]:
    """Percent less of key in a than in b."""
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    return 100. * (1. - float(a[key]) / float(b[key]))


def markdown_table(ratios: Sequence[Dict[str, object]]) -> str:
    def f(v, fmt):
        return 'OOM/-' if v is None else fmt.format(v)

    lines = ['| setting | width | px | infer SSoG/dense | train SSoG/dense | infer mem saved | train mem saved '
             '| infer cost / floor | train cost / floor |',
             '|---|---|---:|---:|---:|---:|---:|---:|---:|']
    for r in ratios:
        lines.append(
            f"| {r['setting']} | {r['width']} | {r['img_size']} | {f(r['infer_speedup'], '{:.2f}x')} | "
            f"{f(r['train_speedup'], '{:.2f}x')} | {f(r['infer_mem_saving'], '{:.0f}%')} | "
            f"{f(r['train_mem_saving'], '{:.0f}%')} | {f(r['infer_cost_over_floor'], '{:.2f}x')} | "
            f"{f(r['train_cost_over_floor'], '{:.2f}x')} |")
    return '\n'.join(lines)


def plot(rows: Sequence[Dict[str, object]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {'ssog': '-', 'dense': '--', 'floor': ':'}
    colors = {'discrete': 'tab:blue', 'looped': 'tab:orange', 'ode': 'tab:green'}
    groups: Dict[Tuple[str, str, str], List[Dict]] = {}
    for r in rows:
        groups.setdefault((r['setting'], r['width'], r['variant']), []).append(r)
    for (s, w, v), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: int(r['infer_img_size']))
        label = f'{s} {w} {v}'
        for ax, key in zip(axes, ('infer_samples_per_sec', 'infer_mem_mb')):
            pts = [(int(r['infer_img_size']), float(r[key])) for r in rs if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), styles[v], marker='o', color=colors[s], label=label)
    axes[0].set(xlabel='resolution (px)', ylabel='inference img/s', yscale='log', title='throughput')
    axes[1].set(xlabel='resolution (px)', ylabel='peak memory above baseline (MB)', yscale='log',
                title='inference peak memory')
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == '__main__':
    child_main(sys.argv[1])
