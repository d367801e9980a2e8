"""Side-by-side cost of the SSoG mixer, dense attention (fused and eager) and an identity mixer (the floor).

For each depth setting, width, resolution and batch size, models that differ only in the token mixer are timed
interleaved (A B C D A B C D ...), warm-up excluded; medians and spread are reported. Variants:

- ``ssog``: the SSoG family (default mixing path); ``ssog_einsum``: the same model on the einsum mixing path;
  ``ssog_steer``: the same model with content-steered kernels (``ssog_steer=True``);
- ``fused``: the dense twin with fused ``F.scaled_dot_product_attention`` (timm's default);
- ``eager``: the dense twin with explicit softmax maps (``fused_attn = False``, as ODE-ViT's code runs it);
- ``floor``: the SSoG model with an identity mixer (the cost of everything but mixing).

Peak memory is measured at the allocator level, in a fresh child process per configuration on CPU (see
``measure_memory_in_process``), with ``torch.cuda.max_memory_allocated`` on CUDA.
"""
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import timm
import torch
import torch._inductor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from timm_odevit import models  # noqa: F401  (registers the models)
from timm_odevit.layers.fused_mixer import separable_mix_by_head
from timm_odevit.models.families import SETTINGS, SIZES, model_name

VARIANTS = ('ssog', 'fused', 'eager', 'floor')
ALL_VARIANTS = VARIANTS + ('ssog_einsum', 'ssog_steer')
PRECISIONS = ('float32', 'bfloat16', 'float16', 'amp_bfloat16', 'amp_float16')
# timm's benchmark.py column names where they exist, then ours
CSV_COLUMNS = [
    'model', 'setting', 'width', 'variant', 'compiled', 'precision', 'status',
    'infer_samples_per_sec', 'infer_step_time', 'infer_step_time_min', 'infer_step_time_max', 'infer_batch_size',
    'infer_img_size', 'infer_gmacs', 'infer_mem_mb',
    'train_samples_per_sec', 'train_step_time', 'train_step_time_min', 'train_step_time_max', 'train_batch_size',
    'train_img_size', 'train_mem_mb',
    'weights_mb', 'infer_rss_mb', 'train_rss_mb', 'mem_method', 'repeats', 'param_count', 'nfe', 'device',
    'compile_mode', 'infer_ops',
]
# torch.compile's modes, from torch itself: 'reduce-overhead' and 'max-autotune' bring CUDA graphs, 'default' none
COMPILE_MODES = tuple(torch._inductor.list_mode_options())
# untimed calls a compiled case gets first: compilation, then CUDA-graph recording ('reduce-overhead' records on a
# later call than the first), then one more to run the recorded graph
COMPILED_WARMUP = 3
NOT_MEASURED = 'n/a'


class BenchmarkConfigError(ValueError):
    """A configuration the benchmark cannot run (unknown model, resolution not divisible by the patch, ...)."""


@dataclass
class Case:
    """One model at one resolution and batch size."""
    setting: str
    width: str
    variant: str
    img_size: int
    batch_size: int
    compiled: bool = False
    compile_mode: str = 'default'
    cuda_graph: bool = False  # each step captured once into a CUDA graph and replayed (``graphed``)

    @property
    def model_name(self) -> str:
        ssog, dense = SETTINGS[self.setting]
        return model_name(dense if self.variant in ('fused', 'eager') else ssog, self.width)

    @property
    def label(self) -> str:
        suffix = {'floor': '+identity', 'eager': '+eager', 'ssog_einsum': '+einsum', 'ssog_steer': '+steer'}.get(
            self.variant, '')
        compiled = ''
        if self.compiled:
            compiled = '/compiled' if self.compile_mode == 'default' else f'/compiled:{self.compile_mode}'
        graph = '/cudagraph' if self.cuda_graph else ''
        return f'{self.model_name}{suffix}@{self.img_size}/b{self.batch_size}{compiled}{graph}'

    def build_eager(self, device: str = 'cpu', dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The model (never compiled): what MACs are counted on."""
        kwargs: Dict[str, Any] = dict(img_size=self.img_size, device=device, dtype=dtype)
        if self.variant == 'floor':
            kwargs['mixer'] = 'identity'
        elif self.variant == 'ssog_steer':
            kwargs['ssog_steer'] = True  # the content-steered kernels (zero probes: the cost, not the output, differs)
        model = timm.create_model(self.model_name, **kwargs)
        for m in model.modules():
            if self.variant == 'eager' and hasattr(m, 'fused_attn'):
                m.fused_attn = False  # materialise the N x N softmax maps
            if self.variant == 'ssog_einsum' and hasattr(m, 'mixing'):
                m.mixing = 'einsum'
        return model

    def build(self, device: str = 'cpu', dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        model = self.build_eager(device, dtype)
        return torch.compile(model, mode=self.compile_mode) if self.compiled else model


@dataclass
class Result:
    case: Case
    precision: str = 'float32'
    status: str = 'ok'
    infer_times: List[float] = field(default_factory=list)
    train_times: List[float] = field(default_factory=list)
    gmacs: Optional[float] = None
    params: Optional[int] = None
    nfe: Optional[int] = None
    ops: Optional[int] = None
    mem: Dict[str, Any] = field(default_factory=dict)
    # the timed model, kept for the memory pass of the cases measured in this process (CUDA, compiled): a compiled
    # model is not compiled again for it
    model: Optional[torch.nn.Module] = field(default=None, repr=False)

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

        mem = self.mem
        row = dict(model=c.label, setting=c.setting, width=c.width, variant=c.variant, compiled=int(c.compiled),
                   precision=self.precision, status=self.status,
                   infer_batch_size=c.batch_size, infer_img_size=c.img_size,
                   train_batch_size=c.batch_size, train_img_size=c.img_size,
                   device=device, param_count=round(self.params / 1e6, 3) if self.params else None,
                   infer_gmacs=round(self.gmacs, 3) if self.gmacs is not None else None, nfe=self.nfe,
                   repeats=len(self.infer_times) or None, compile_mode=c.compile_mode if c.compiled else '',
                   infer_ops=self.ops)
        # a memory value that was not measured is 'n/a', never confused with an OOM
        for key in ('infer_mem_mb', 'train_mem_mb', 'weights_mb', 'infer_rss_mb', 'train_rss_mb'):
            row[key] = _round(mem[key]) if mem.get(key) is not None else NOT_MEASURED
        row['mem_method'] = mem.get('method', NOT_MEASURED)
        row.update(stats(self.infer_times, 'infer'))
        row.update(stats(self.train_times, 'train'))
        return row


def _round(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 1)


def validate(
        settings: Sequence[str],
        widths: Sequence[str],
        resolutions: Sequence[int],
        variants: Sequence[str] = VARIANTS,
        batch_sizes: Sequence[int] = (1,),
        repeats: int = 1,
) -> None:
    """Fail before any work on names or sizes the run cannot use."""
    for s in settings:
        if s not in SETTINGS:
            raise BenchmarkConfigError(f'Unknown depth setting {s!r}; choose from {list(SETTINGS)}.')
    for v in variants:
        if v not in ALL_VARIANTS:
            raise BenchmarkConfigError(f'Unknown variant {v!r}; choose from {list(ALL_VARIANTS)}.')
    registered = set(timm.list_models())
    for s in settings:
        for w in widths:
            for name in SETTINGS[s]:
                if f'{name}_{w}' not in registered:
                    raise BenchmarkConfigError(f'Unknown model {name}_{w!s}: width {w!r} is not one of {list(SIZES)}.')
    for r in resolutions:
        if r <= 0:
            raise BenchmarkConfigError(f'Resolution {r} is not positive; give a multiple of 16 (e.g. 224).')
        if r % 16:
            raise BenchmarkConfigError(
                f'Resolution {r} is not divisible by the patch size 16; use a multiple of 16 '
                f'(e.g. {16 * max(1, r // 16)}).')
    for b in batch_sizes:
        if b <= 0:
            raise BenchmarkConfigError(f'Batch size {b} is not positive; give batch sizes >= 1.')
    if repeats <= 0:
        raise BenchmarkConfigError(f'--repeats {repeats} would time nothing; give at least 1.')


def is_oom(e: BaseException) -> bool:
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and ('out of memory' in str(e) or "can't allocate memory" in str(e))


def _sync(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def parse_precision(precision: str) -> Tuple[torch.dtype, Optional[torch.dtype]]:
    """(weights and input dtype, autocast dtype or None): 'bfloat16' is pure bf16, 'amp_bfloat16' is autocast."""
    if precision not in PRECISIONS:
        raise BenchmarkConfigError(f'Unknown precision {precision!r}; choose from {list(PRECISIONS)}.')
    if precision.startswith('amp_'):
        return torch.float32, getattr(torch, precision[4:])
    return getattr(torch, precision), None


def make_input(case: Case, device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(case.batch_size, 3, case.img_size, case.img_size, device=device, dtype=dtype)


def make_steps(
        model: torch.nn.Module,
        case: Case,
        device: str,
        dtype: torch.dtype,
        amp_dtype: Optional[torch.dtype] = None,
) -> Tuple[Callable, Callable]:
    """(inference step, training step) closures over one fixed input batch."""
    x = make_input(case, device, dtype)
    target = torch.randint(0, 1000, (case.batch_size,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    loss_fn = torch.nn.CrossEntropyLoss()
    device_type = torch.device(device).type

    def autocast():
        return torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None)

    def infer() -> None:
        model.eval()
        with torch.inference_mode(), autocast():
            model(x)

    def train() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model(x).float(), target)
        loss.backward()
        opt.step()

    if case.cuda_graph:
        return graphed(infer), graphed(train)
    return infer, train


def graphed(step: Callable[[], None], warmup: int = 3) -> Callable[[], None]:
    """``step`` captured into a CUDA graph on its first call (after ``warmup`` runs on a side stream, as PyTorch's
    whole-network capture does) and replayed on every call: what an eager model costs without host launches."""
    graph: Optional[torch.cuda.CUDAGraph] = None

    def replay() -> None:
        nonlocal graph
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        graph.replay()

    return replay


def count_gmacs(
        model: torch.nn.Module,
        img_size: int,
        device: str = 'cpu',
        dtype: torch.dtype = torch.float32,
) -> float:
    """Multiply-accumulates of one image's forward pass, in billions."""
    x = torch.randn(1, model.in_chans, img_size, img_size, device=device, dtype=dtype)
    model.eval()
    # the math backend: the fused CPU attention kernel has no flop formula and would count as zero; the in-place
    # batched matmul-add and the separable mixing op have none either (IN_PLACE_FLOPS gives them theirs)
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), \
            FlopCounterMode(display=False, custom_mapping=IN_PLACE_FLOPS) as counter:
        model(x)
    return counter.get_total_flops() / 2e9


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that launch work: every op the dispatcher sees except views and the aliasing reshape
    (``_unsafe_view``). On a GPU each is at least one kernel launch, so at small sizes they set the time."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten._unsafe_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(model: torch.nn.Module, x: torch.Tensor, amp_dtype: Optional[torch.dtype] = None) -> int:
    """Ops per inference forward of ``model`` on ``x``, the second of two: the first builds what the model keeps
    between inference forwards (the SSoG kernels), which a steady stream of inference does not pay again."""
    model.eval()
    autocast = torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    with torch.inference_mode(), autocast:
        model(x)
        with OpCounter() as counter:
            model(x)
    return counter.count


def _baddbmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Flops of ``self.baddbmm_(a, b)``, which torch's counter scores as zero: 2 per multiply-add of a @ b."""
    batch, m, k = a_shape
    return 2 * batch * m * k * b_shape[-1]


def _separable_mix_flops(v_shape, band_y_shape, rows_y_shape, band_x_shape, rows_x_shape, height, width, *args,
                         out_shape=None, **kwargs) -> int:
    """Flops of ``separable_mix``, one op the counter cannot look into: per channel and image, every component's x
    axis (H x W outputs of W multiply-adds) and y axis (H x W outputs of H), 2 per multiply-add (the expansion of
    the kernels from their factors, O(K (H^2 + W^2)) per head, is left out as the softmax of attention is)."""
    batch, _, channels = v_shape
    return 2 * batch * channels * band_y_shape[1] * height * width * (width + height)


# ops torch's counter scores as zero: the in-place batched matmul-add, and our one-op separable mixing
IN_PLACE_FLOPS = {torch.ops.aten.baddbmm_: _baddbmm_flops,
                  torch.ops.timm_odevit.separable_mix: _separable_mix_flops}


def case_gmacs(case: Case) -> float:
    """GMACs per image of a case, counted on meta tensors (shapes only: instant at any size, no memory)."""
    try:
        return count_gmacs(case.build_eager('meta'), case.img_size, 'meta')
    except (NotImplementedError, RuntimeError):  # an op without a meta kernel: count on the CPU at batch 1
        return count_gmacs(case.build_eager('cpu'), case.img_size, 'cpu')


def eager_map_bytes(case: Case, num_heads: int, evals: int, elem_bytes: int, train: bool) -> int:
    """What the softmax maps of an eager dense case need: two live maps in inference, two kept per block
    evaluation (logits' softmax and its dropout) plus two in flight for a training step."""
    n = (case.img_size // 16) ** 2 + 1
    per_map = case.batch_size * num_heads * n * n * elem_bytes
    return per_map * (2 * evals + 2 if train else 2)


def memory_budget(device: str) -> int:
    """Bytes a case may plan to use: 85% of the GPU, 40% of the available host memory (others share it)."""
    if device.startswith('cuda'):
        return int(0.85 * torch.cuda.get_device_properties(torch.device(device)).total_memory)
    with open('/proc/meminfo') as f:
        info = {line.split(':')[0]: int(line.split()[1]) * 1024 for line in f}
    return int(0.4 * info.get('MemAvailable', info['MemTotal']))


def precheck(case: Case, device: str, elem_bytes: int, do_train: bool, budget: Optional[int] = None) -> Optional[str]:
    """A status for an eager dense case whose N x N maps cannot fit, before anything is allocated, else None:
    'skip: ...' (nothing fits) or 'train skipped: ...' (inference is still measured)."""
    if case.variant != 'eager':
        return None
    from timm_odevit.models.trunk import WIDTHS
    budget = memory_budget(device) if budget is None else budget
    heads = WIDTHS[case.width]['num_heads']
    for train in (False, True) if do_train else (False,):
        need = eager_map_bytes(case, heads, 12, elem_bytes, train)
        if need > budget:
            return (f'{"train skipped" if train else "skip"}: maps need ~{need / 2 ** 30:.1f} GiB > budget '
                    f'{budget / 2 ** 30:.1f} GiB')
    return None


def runnable(status: str) -> bool:
    """Whether a case runs at all (possibly without its training step)."""
    return status == 'ok' or status.startswith('train skipped')


def time_interleaved(
        cases: Sequence[Case],
        repeats: int,
        warmup: int,
        device: str,
        dtype: torch.dtype,
        do_train: bool = True,
        progress: Optional[Callable[[str], None]] = None,
        amp_dtype: Optional[torch.dtype] = None,
        time_budget: Optional[float] = None,
        precision: str = 'float32',
        budget: Optional[int] = None,
) -> List[Result]:
    """Build every case, then time inference and training steps A B C A B C ...; OOM marks a case, others go on.

    Compiled cases get at least ``COMPILED_WARMUP`` untimed rounds. With ``time_budget`` (seconds per case and kind),
    repeats are cut to what fits after the first round. Each result keeps its model (``Result.model``) and the ops
    of one inference forward, counted on the uncompiled model (``count_ops``)."""
    if any(c.compiled or c.cuda_graph for c in cases):
        warmup = max(warmup, COMPILED_WARMUP)
    results = [Result(c, precision=precision) for c in cases]
    steps: List[Optional[Tuple[Callable, Callable]]] = []
    models_: List[Optional[torch.nn.Module]] = []
    # autocast computes softmax in float32: eager maps take 4 bytes per entry there whatever the autocast dtype
    elem_bytes = 4 if amp_dtype is not None else torch.finfo(dtype).bits // 8
    for r in results:
        skip = precheck(r.case, device, elem_bytes, do_train, budget)
        if skip:
            r.status = skip
            if not runnable(skip):
                steps.append(None)
                models_.append(None)
                continue
        try:
            r.gmacs = case_gmacs(r.case)
            r.ops = count_ops(r.case.build_eager(device, dtype), make_input(r.case, device, dtype), amp_dtype)
            model = r.case.build(device, dtype)
            r.params = sum(p.numel() for p in model.parameters())
            steps.append(make_steps(model, r.case, device, dtype, amp_dtype))
            models_.append(model)
        except Exception as e:  # noqa: BLE001 -- an OOM is a result, anything else is re-raised
            if not is_oom(e):
                raise
            r.status = 'OOM'
            steps.append(None)
            models_.append(None)
    for kind in ('infer', 'train') if do_train else ('infer',):
        total = warmup + repeats
        rep = 0
        while rep < total:
            round_times = []
            for r, st in zip(results, steps):
                if st is None or not (r.status == 'ok' or (kind == 'infer' and runnable(r.status))):
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
                    if device.startswith('cuda'):
                        torch.cuda.empty_cache()
                    continue
                round_times.append(elapsed)
                if rep >= warmup:
                    (r.infer_times if kind == 'infer' else r.train_times).append(elapsed)
            rep += 1
            if time_budget and rep == 1 and round_times:
                # the first round (a warm-up one when there is warm-up) sizes the rest: at least one timed round
                fits = int(time_budget / max(sum(round_times), 1e-9))
                total = min(total, max(warmup + 1, fits))
            if progress:
                progress(f'{kind} repeat {rep}/{total}')
    for r, model in zip(results, models_):
        if model is not None:
            r.nfe = getattr(model, 'nfe', None)  # counted by the last forward
            r.model = model
    return results


# ---- peak memory


class LiveStorageTracker(TorchDispatchMode):
    """Peak bytes of live tensor storages created while active, as the allocator sees them through the dispatcher.

    Every storage an op returns is counted once, by its ``nbytes``, from its creation until its last reference dies
    (a weakref finalizer on the storage). Views and in-place results share a counted storage and add nothing.
    Storages that existed before (weights, the input) are not counted: ``peak`` is what a step adds on top of them.
    Our own custom op (``separable_mix``) is followed inside off CUDA, where its kernel is PyTorch code: its per-head
    scratch counts. Not seen: scratch buffers a compiled kernel allocates and frees inside one op (e.g. the fused CPU
    attention's per-thread blocks), and code that allocates outside the dispatcher (inductor's generated kernels).
    """

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self.live = 0
        self.peak = 0
        self._seen: Dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.enabled and func is torch.ops.timm_odevit.separable_mix.default and args[0].device.type != 'cuda':
            with self:  # the mode is off inside a dispatch: on again, the op's own aten calls are tracked
                return separable_mix_by_head(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if not self.enabled:
            return out
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == 'meta':
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._seen:
                continue
            self._seen[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._release, key)
        self.peak = max(self.peak, self.live)
        return out


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


def measure_memory_in_process(
        case: Case,
        device: str,
        dtype: torch.dtype,
        do_train: bool = True,
        amp_dtype: Optional[torch.dtype] = None,
        model: Optional[torch.nn.Module] = None,
) -> Dict[str, Any]:
    """Allocator-level peak memory of one inference forward and one training step, in MiB above what is live before
    the step (weights, input).

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus ``memory_allocated`` before.
    CPU: ``LiveStorageTracker`` (peak of live storages created during the step), plus the process's peak resident
    memory above its level before the step as an extra (RSS follows what the C allocator keeps, not what is live).
    The CPU measures the first step of each kind (the tracker counts what a step creates, gradients included, and
    eager CPU code has no lazy state to warm); CUDA and compiled models take one untimed warm-up step first.
    Meant to run in a fresh process per configuration, so nothing earlier hides in the peak, except for a ``model``
    already built and warmed by the timing (a compiled one is not compiled again)."""
    model = case.build(device, dtype) if model is None else model
    infer, train = make_steps(model, case, device, dtype, amp_dtype)
    out: Dict[str, Any] = dict(weights_mb=sum(t.numel() * t.element_size() for t in
                                              list(model.parameters()) + list(model.buffers())) / 2 ** 20)
    cuda = device.startswith('cuda')
    # the tracker cannot see allocations inside inductor's kernels: on CPU a compiled case reports RSS only
    tracked = not cuda and not case.compiled
    out['method'] = 'cuda_max_allocated' if cuda else ('live_storages' if tracked else 'rss_only')
    for kind, fn in (('infer', infer), ('train', train)) if do_train else (('infer', infer),):
        if cuda or case.compiled:
            fn()  # warm-up: lazy initialisation (cuBLAS workspaces), compilation
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            out[f'{kind}_mem_mb'] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            continue
        # one step gives both numbers: the tracker's bookkeeping is a few Python objects, invisible in RSS
        base = _rss_kb('VmRSS')
        _reset_peak_rss()
        with LiveStorageTracker(enabled=tracked) as tracker:
            fn()
        out[f'{kind}_rss_mb'] = (_rss_kb('VmHWM') - base) / 1024
        if tracked:
            out[f'{kind}_mem_mb'] = tracker.peak / 2 ** 20
    return out


def measure_memory(
        case: Case,
        device: str,
        dtype: torch.dtype,
        do_train: bool = True,
        timeout: float = 1800.,
        amp_dtype: Optional[torch.dtype] = None,
        budget: Optional[int] = None,
        model: Optional[torch.nn.Module] = None,
) -> Tuple[str, Dict[str, Any]]:
    """Peak memory of one case: in a fresh child process on CPU, in this process on CUDA or for a compiled case on
    either, on the timed ``model`` when given (RSS only for a compiled CPU case). (status, values).

    The CPU child runs under an address-space limit of ``budget`` bytes above its start, so a case too large for
    this machine fails as an allocation error (reported 'OOM') instead of waking the kernel's OOM killer."""
    if device.startswith('cuda') or case.compiled:
        try:
            return 'ok', measure_memory_in_process(case, device, dtype, do_train, amp_dtype, model)
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            if device.startswith('cuda'):
                torch.cuda.empty_cache()
            return 'OOM', {}
    spec = dict(case=asdict(case), device=device, dtype=str(dtype).replace('torch.', ''), train=do_train,
                amp=str(amp_dtype).replace('torch.', '') if amp_dtype else None,
                budget=memory_budget(device) if budget is None else budget)
    cmd = [sys.executable, '-m', 'timm_odevit_tools.benchmark.runner', json.dumps(spec)]
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
    if spec.get('budget'):
        limit = _rss_kb('VmSize') * 1024 + int(spec['budget'])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    case = Case(**spec['case'])
    amp = getattr(torch, spec['amp']) if spec.get('amp') else None
    try:
        out = measure_memory_in_process(case, spec['device'], getattr(torch, spec['dtype']), spec['train'], amp)
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


def read_csv(path: str) -> List[Dict[str, object]]:
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _num(row: Optional[Dict], key: str) -> Optional[float]:
    """A measured positive number from a row, None when missing, 'n/a', OOM or skipped."""
    if not row:
        return None
    try:
        v = float(row.get(key))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a / b


def ratio_rows(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per (setting, width, resolution, batch, compiled): SSoG against fused and eager dense (throughput ratio,
    memory ratio), and SSoG's cost over the floor (time ratio) next to its ideal (the MAC ratio)."""
    def key(r):
        return (r['setting'], r['width'], int(r['infer_img_size']), int(r.get('infer_batch_size') or 1),
                int(r.get('compiled') or 0))

    index = {key(r) + (r['variant'],): r for r in rows}
    out = []
    setting_order = list(SETTINGS)
    keys = sorted({k[:-1] for k in index}, key=lambda k: (setting_order.index(k[0]), k[1], k[2], k[3], k[4]))
    for k in keys:
        ssog, fused, eager, floor = (index.get(k + (v,)) for v in VARIANTS)
        r: Dict[str, object] = dict(setting=k[0], width=k[1], img_size=k[2], batch_size=k[3], compiled=k[4])
        for kind in ('infer', 'train'):
            sps = f'{kind}_samples_per_sec'
            mem = f'{kind}_mem_mb'
            r[f'{kind}_vs_fused'] = _div(_num(ssog, sps), _num(fused, sps))
            r[f'{kind}_vs_eager'] = _div(_num(ssog, sps), _num(eager, sps))
            r[f'{kind}_mem_vs_fused'] = _div(_num(ssog, mem), _num(fused, mem))
            r[f'{kind}_mem_vs_eager'] = _div(_num(ssog, mem), _num(eager, mem))
            # time per sample of SSoG over the floor's = floor throughput / SSoG throughput
            r[f'{kind}_cost_over_floor'] = _div(_num(floor, sps), _num(ssog, sps))
        r['mac_ratio'] = _div(_num(ssog, 'infer_gmacs'), _num(floor, 'infer_gmacs'))
        r['ops_vs_fused'] = _div(_num(ssog, 'infer_ops'), _num(fused, 'infer_ops'))
        out.append(r)
    return out


def markdown_table(ratios: Sequence[Dict[str, object]]) -> str:
    """Throughput as SSoG/baseline (higher is better for SSoG), memory as SSoG/baseline (lower is better), cost as
    SSoG time / floor time next to the MAC ratio it would have with no implementation overhead."""
    def f(v, fmt='{:.2f}x'):
        return '-' if v is None else fmt.format(v)

    lines = ['| setting | width | px | batch | compiled | infer speed vs fused | vs eager | train speed vs fused '
             '| vs eager | infer mem vs fused | vs eager | train mem vs fused | vs eager | infer cost / floor '
             '| train cost / floor | MACs / floor | ops vs fused |',
             '|---|---|---:|---:|---|' + '---:|' * 12]
    for r in ratios:
        cells = [r['setting'], r['width'], r['img_size'], r['batch_size'], 'yes' if r['compiled'] else 'no']
        cells += [f(r[k]) for k in ('infer_vs_fused', 'infer_vs_eager', 'train_vs_fused', 'train_vs_eager',
                                    'infer_mem_vs_fused', 'infer_mem_vs_eager', 'train_mem_vs_fused',
                                    'train_mem_vs_eager', 'infer_cost_over_floor', 'train_cost_over_floor',
                                    'mac_ratio', 'ops_vs_fused')]
        lines.append('| ' + ' | '.join(str(c) for c in cells) + ' |')
    return '\n'.join(lines)


def absolute_table(rows: Sequence[Dict[str, object]]) -> str:
    """Per row: ms per step, samples/s, allocator peaks (MiB above weights and input), RSS, MACs, ops per inference
    forward, status."""
    def f(r, k):
        v = r.get(k)
        return '-' if v in (None, '') else str(v)

    lines = ['| model | status | infer ms | infer img/s | train ms | train img/s | infer peak MiB | train peak MiB '
             '| infer RSS MiB | train RSS MiB | GMACs | ops |',
             '|---|---|' + '---:|' * 10]
    for r in rows:
        lines.append('| ' + ' | '.join([str(r['model']), str(r['status'])] + [f(r, k) for k in (
            'infer_step_time', 'infer_samples_per_sec', 'train_step_time', 'train_samples_per_sec', 'infer_mem_mb',
            'train_mem_mb', 'infer_rss_mb', 'train_rss_mb', 'infer_gmacs', 'infer_ops')]) + ' |')
    return '\n'.join(lines)


def plot(rows: Sequence[Dict[str, object]], path: str, title: str) -> None:
    from ..plots import pyplot
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {'ssog': '-', 'ssog_einsum': '-.', 'ssog_steer': (0, (5, 1)), 'fused': '--', 'eager': (0, (1, 1)),
              'floor': ':'}
    colors = {'ssog': 'tab:green', 'ssog_einsum': 'tab:olive', 'ssog_steer': 'tab:purple', 'fused': 'tab:blue',
              'eager': 'tab:red', 'floor': 'tab:gray'}
    groups: Dict[Tuple, List[Dict]] = {}
    for r in rows:
        groups.setdefault((r['setting'], r['width'], r['variant'], r.get('infer_batch_size'),
                           r.get('compiled')), []).append(r)
    for (s, w, v, b, c), rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        rs = sorted(rs, key=lambda r: int(r['infer_img_size']))
        label = f'{s} {w} b{b}{" compiled" if str(c) == "1" else ""} {v}'
        for ax, key in zip(axes, ('infer_samples_per_sec', 'infer_mem_mb', 'train_mem_mb')):
            pts = [(int(r['infer_img_size']), _num(r, key)) for r in rs]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                ax.plot(*zip(*pts), linestyle=styles.get(v, '-'), marker='o', color=colors.get(v), label=label,
                        alpha=0.8)
    axes[0].set(xlabel='resolution (px)', ylabel='inference img/s', yscale='log', title='throughput')
    axes[1].set(xlabel='resolution (px)', ylabel='MiB above weights and input', yscale='log',
                title='inference peak (allocator)')
    axes[2].set(xlabel='resolution (px)', ylabel='MiB above weights and input', yscale='log',
                title='training-step peak (allocator)')
    if axes[2].get_legend_handles_labels()[0] or axes[0].get_legend_handles_labels()[0]:
        (axes[2] if axes[2].get_legend_handles_labels()[0] else axes[0]).legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == '__main__':
    child_main(sys.argv[1])
