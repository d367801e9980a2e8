"""The benchmark harness on tiny configurations: outputs, ratios, allocator-level memory in a child, OOM and skips,
bad input, and the GPU script's CPU dry run. No speed is asserted: speed and memory are what the benchmark reports,
not what tests check."""
import csv
import os
import re
import subprocess
import sys

import pytest
import torch

from timm_odevit_tools.benchmark import runner
from timm_odevit_tools.benchmark.__main__ import main
from timm_odevit_tools.benchmark.runner import (
    CSV_COLUMNS, NOT_MEASURED, VARIANTS, BenchmarkConfigError, Case, LiveStorageTracker, ratio_rows, validate,
)
from timm_odevit.layers import MultiHeadAttention, SeparableGaussianMixer
from timm_odevit.models.families import FAMILIES
from tiers import slow_except

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_end_to_end_outputs(tmp_path, capsys):
    rc = main(['--settings', 'ode', '--widths', 'tiny', '--resolutions', '32', '48', '--repeats', '1',
               '--batch-sizes', '1', '2', '--no-train', '--no-memory', '--out-dir', str(tmp_path)])
    assert rc == 0
    rows = _read(tmp_path / 'benchmark.csv')
    assert list(rows[0].keys()) == CSV_COLUMNS
    assert {r['variant'] for r in rows} == set(VARIANTS)
    assert {(r['infer_img_size'], r['infer_batch_size']) for r in rows} == {
        (s, b) for s in ('32', '48') for b in ('1', '2')}
    for r in rows:
        assert r['status'] == 'ok'
        assert float(r['infer_samples_per_sec']) > 0 and r['train_samples_per_sec'] == ''
        assert float(r['infer_gmacs']) > 0 and float(r['param_count']) > 0
        assert int(r['nfe']) == 12
    # same model family differs only in the mixer: the floor has the fewest MACs, dense the most at equal size
    by_variant = {(r['variant'], r['infer_img_size']): float(r['infer_gmacs']) for r in rows}
    assert by_variant[('floor', '48')] < by_variant[('ssog', '48')] < by_variant[('fused', '48')]
    assert by_variant[('fused', '48')] == by_variant[('eager', '48')]
    png = (tmp_path / 'benchmark.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n'
    md = (tmp_path / 'benchmark.md').read_text()
    assert '| ode | tiny | 32 | 1 | no |' in md and '| ode | tiny | 48 | 2 | no |' in md
    assert 'MACs / floor' in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize('timing', [True, False])
def test_end_to_end_memory_in_children(tmp_path, timing):
    assert main(['--settings', 'ode', '--widths', 'tiny', '--resolutions', '32', '--repeats', '1', '--warmup', '0',
                 '--batch-sizes', '2', '--variants', 'ssog', 'eager', '--out-dir', str(tmp_path)]
                + ([] if timing else ['--no-timing'])) == 0
    for r in _read(tmp_path / 'benchmark.csv'):
        assert (r['infer_step_time'] != '') == timing and float(r['infer_gmacs']) > 0
        # allocator-level peaks from the live-storage tracker, RSS beside them
        assert r['status'] == 'ok' and r['mem_method'] == 'live_storages'
        assert 0 < float(r['infer_mem_mb']) < float(r['train_mem_mb'])
        assert float(r['weights_mb']) > 0 and r['train_rss_mb'] != NOT_MEASURED


def test_no_memory_is_not_reported_as_oom(tmp_path, capsys):
    assert main(['--settings', 'ode', '--widths', 'tiny', '--resolutions', '32', '--repeats', '1', '--warmup', '0',
                 '--batch-sizes', '1', '--no-memory', '--variants', 'ssog', 'floor', '--out-dir', str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert 'OOM' not in out and NOT_MEASURED in out
    for r in _read(tmp_path / 'benchmark.csv'):
        assert r['status'] == 'ok'
        assert r['infer_mem_mb'] == r['train_mem_mb'] == r['mem_method'] == NOT_MEASURED
        assert float(r['train_samples_per_sec']) > 0


def test_variants_build_the_baselines():
    eager = Case('ode', 'tiny', 'eager', 32, 1).build_eager()
    fused = Case('ode', 'tiny', 'fused', 32, 1).build_eager()
    attn = [m for m in eager.modules() if isinstance(m, MultiHeadAttention)]
    assert attn and not any(m.fused_attn for m in attn)
    assert all(m.fused_attn for m in fused.modules() if isinstance(m, MultiHeadAttention))
    einsum = Case('ode', 'tiny', 'ssog_einsum', 32, 1).build_eager()
    assert {m.mixing for m in einsum.modules() if isinstance(m, SeparableGaussianMixer)} == {'einsum'}
    floor = Case('ode', 'tiny', 'floor', 32, 1).build_eager()
    assert not any(isinstance(m, (SeparableGaussianMixer, MultiHeadAttention)) for m in floor.modules())
    steer = Case('ode', 'tiny', 'ssog_steer', 32, 1)
    assert {m.steer for m in steer.build_eager().modules() if isinstance(m, SeparableGaussianMixer)} == {True}
    assert steer.label == 'ssog_ode_tiny+steer@32/b1'
    assert Case('ode', 'tiny', 'ssog', 32, 1).model_name == 'ssog_ode_tiny'
    assert Case('discrete', 'small', 'eager', 32, 1).model_name == 'dense_vit_small'


def test_compiled_case_wraps_the_model_and_counts_macs_on_the_plain_one():
    case = Case('discrete', 'tiny', 'ssog', 32, 1, compiled=True)
    model = case.build()
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)  # compiled lazily, on its first call
    assert case.label.endswith('/compiled')
    assert runner.case_gmacs(case) == runner.case_gmacs(Case('discrete', 'tiny', 'ssog', 32, 1))


def test_compile_mode_is_named_and_compiled_cases_warm_up(monkeypatch):
    """--compile-mode reaches torch.compile; compiled cases get COMPILED_WARMUP untimed rounds whatever --warmup says,
    and the memory pass reuses the timed (compiled) model instead of compiling another."""
    case = Case('ode', 'tiny', 'ssog', 32, 1, compiled=True, compile_mode='reduce-overhead')
    assert case.label.endswith('/compiled:reduce-overhead')
    calls = []
    monkeypatch.setattr(torch, 'compile', lambda model, mode=None: calls.append(mode) or model)
    results = runner.time_interleaved([case], repeats=1, warmup=0, device='cpu', dtype=torch.float32,
                                      do_train=False)
    assert calls == ['reduce-overhead']
    model = results[0].model
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    status, mem = runner.measure_memory(case, 'cpu', torch.float32, do_train=False, model=model)
    assert status == 'ok' and calls == ['reduce-overhead'] and forwards and mem['method'] == 'rss_only'
    timed = []
    monkeypatch.setattr(runner, 'make_steps', lambda *a, **k: (lambda: timed.append(1), lambda: None))
    runner.time_interleaved([case], repeats=2, warmup=0, device='cpu', dtype=torch.float32, do_train=False)
    assert len(timed) == runner.COMPILED_WARMUP + 2


def test_gmacs_count_in_place_matmuls_and_the_separable_op():
    """The accumulate path adds each Gaussian component with an in-place baddbmm_, and the fused path is one custom
    op, both of which torch's counter scores as zero: counted, their MACs equal the einsum path's (the same
    contractions)."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn(2, 1 + 12 * 10, 48)
    macs = {}
    for mixing in ('accumulate', 'fused', 'einsum'):
        m = SeparableGaussianMixer(48, 3, num_gaussians=4, mixing=mixing)
        with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=runner.IN_PLACE_FLOPS) as counter:
            m(x, (12, 10))
        macs[mixing] = counter.get_total_flops()
    assert macs['accumulate'] == macs['fused'] == macs['einsum'] > 0


@pytest.mark.parametrize('setting,img_size', slow_except([('ode', 224), ('discrete', 224), ('ode', 1024)],
                                                     fast=lambda c: c == ('ode', 224)))
def test_ssog_ops_per_forward_at_most_the_fused_twin(setting, img_size):
    """Ops per inference forward (bf16 autocast, batch 1), what sets a GPU's time at small sizes: SSoG issues no more
    than its fused-attention twin, at 224 px (one bmm per evaluation with the N x N operator, its kernels built once
    for an unchanged model) and at 1024 px (the one-op separable mixing, as fused attention is one op)."""
    ops, nfe = {}, {}
    for variant in ('ssog', 'fused'):
        case = Case(setting, 'tiny', variant, img_size, 1)
        model = case.build_eager()
        ops[variant] = runner.count_ops(model, runner.make_input(case, 'cpu', torch.float32), torch.bfloat16)
        nfe[variant] = model.nfe
    assert nfe['ssog'] == nfe['fused'] == 12
    assert ops['ssog'] <= ops['fused'], ops


def test_ratio_computation():
    def row(variant, ips, tps, mem, gmacs):
        return dict(setting='ode', width='tiny', variant=variant, infer_img_size=224, infer_batch_size=8,
                    compiled=0, infer_samples_per_sec=ips, train_samples_per_sec=tps, infer_mem_mb=mem,
                    train_mem_mb=mem and 2 * mem, infer_gmacs=gmacs)
    rows = [row('ssog', 30., 9., 40., 6.), row('fused', 10., 3., 50., 20.), row('eager', 6., 2., 200., 20.),
            row('floor', 36., 12., 30., 4.)]
    ratios = ratio_rows(rows)
    assert len(ratios) == 1
    r = ratios[0]
    assert r['batch_size'] == 8
    assert r['infer_vs_fused'] == pytest.approx(3.0) and r['train_vs_eager'] == pytest.approx(4.5)
    assert r['infer_mem_vs_fused'] == pytest.approx(0.8) and r['train_mem_vs_eager'] == pytest.approx(0.2)
    # cost over the floor is a time ratio (floor throughput / SSoG throughput), its ideal the MAC ratio
    assert r['infer_cost_over_floor'] == pytest.approx(1.2) and r['train_cost_over_floor'] == pytest.approx(12 / 9)
    assert r['mac_ratio'] == pytest.approx(1.5)
    # a side that was not measured (n/a) or ran out of memory gives no ratio instead of a wrong one
    missing = ratio_rows([row('ssog', 30., 9., 40., 6.), dict(row('fused', None, None, NOT_MEASURED, 20.),
                                                             status='OOM')])[0]
    assert missing['infer_vs_fused'] is None and missing['infer_mem_vs_fused'] is None
    assert missing['infer_cost_over_floor'] is None and missing['mac_ratio'] is None


def test_live_storage_tracker_counts_each_storage_once_while_alive():
    n = 1 << 18  # 1 MiB of float32
    with LiveStorageTracker() as t:
        a = torch.ones(n)
        view = a[: n // 2]  # a view adds nothing
        a.add_(1)  # an in-place result adds nothing
        b = a * 2
        del a, view  # a's storage dies here
        c = b + 1
        peak_before_del = t.peak
        del b, c
    assert peak_before_del == 2 * 4 * n and t.peak == 2 * 4 * n
    assert t.live == 0


def test_accumulate_mixing_peaks_below_einsum():
    """The accumulate path never builds the K-fold intermediate: its peak inside the mixer is below the einsum
    path's, in inference and in a forward and backward."""
    x = torch.randn(2, 1 + 16 * 16, 48)
    peaks = {}
    for mixing in ('accumulate', 'einsum'):
        torch.manual_seed(0)
        m = SeparableGaussianMixer(48, 3, num_gaussians=4, mixing=mixing)
        with torch.no_grad(), LiveStorageTracker() as infer:
            m(x, (16, 16))
        xr = x.clone().requires_grad_()
        with LiveStorageTracker() as train:
            m(xr, (16, 16)).sum().backward()
        peaks[mixing] = infer.peak, train.peak
    assert peaks['accumulate'][0] < 0.7 * peaks['einsum'][0]
    assert peaks['accumulate'][1] < peaks['einsum'][1]


def test_live_storage_tracker_sees_inside_the_separable_op_off_cuda():
    """The one-op mixing's per-head scratch counts (its CPU kernel is PyTorch code the tracker follows): a call
    peaks above its output and a head's K-fold result, and below the einsum path's K-fold intermediate of all heads,
    with the same output."""
    from timm_odevit.layers import SeparableGaussianMixer
    from timm_odevit.layers.fused_mixer import separable_mix
    from test_fused_mixer import separable_mix_reference
    B, H, W, heads, d, K = 1, 16, 16, 3, 16, 4
    v = torch.randn(d * heads, B, 1 + H * W).permute(1, 2, 0)  # channel-major, as the mixer passes it
    mixer = SeparableGaussianMixer(heads * d, heads, num_gaussians=K, mixing='fused')
    with torch.no_grad():
        factors = mixer.field_constants((H, W))['kernels'].tensors
        gy, gx, mix = mixer.kernels((H, W))
    with torch.no_grad(), LiveStorageTracker() as fused:
        out = separable_mix(v, *factors, H, W, True)
    with torch.no_grad(), LiveStorageTracker() as einsum:
        ref = separable_mix_reference(v, gy * mix[..., None, None], gx, H, W, True)
    torch.testing.assert_close(out, ref)
    values = v.numel() * v.element_size()
    assert values + K * values // heads < fused.peak < einsum.peak


def test_memory_measured_in_fresh_child():
    case = Case('looped', 'tiny', 'fused', 64, 2)
    status, mem = runner.measure_memory(case, 'cpu', torch.float32)
    assert status == 'ok' and mem['method'] == 'live_storages'
    assert mem['infer_mem_mb'] > 0 and mem['train_mem_mb'] > mem['infer_mem_mb']
    assert mem['weights_mb'] > 0 and 'infer_rss_mb' in mem


def test_child_over_its_budget_is_oom_not_a_kill():
    # the address-space limit turns a case too large for its budget into an allocation error inside the child
    assert runner.measure_memory(Case('ode', 'tiny', 'fused', 64, 1), 'cpu', torch.float32, budget=1 << 20) == (
        'OOM', {})


def test_child_killed_is_reported_as_oom(monkeypatch):
    monkeypatch.setattr(runner.subprocess, 'run',
                        lambda *a, **k: subprocess.CompletedProcess(a, -9, stdout='', stderr=''))
    assert runner.measure_memory(Case('ode', 'tiny', 'ssog', 32, 1), 'cpu', torch.float32) == ('OOM', {})


def test_oom_marks_the_case_and_the_run_goes_on(monkeypatch):
    real_build = Case.build

    def build(self, *args, **kwargs):
        if self.variant == 'fused':
            raise RuntimeError('[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can\'t allocate memory')
        return real_build(self, *args, **kwargs)

    monkeypatch.setattr(Case, 'build', build)
    cases = [Case('ode', 'tiny', v, 32, 1) for v in VARIANTS]
    results = runner.time_interleaved(cases, repeats=1, warmup=0, device='cpu', dtype=torch.float32)
    assert [r.status for r in results] == ['ok', 'OOM', 'ok', 'ok']
    assert results[0].infer_times and results[3].train_times and not results[1].infer_times
    assert results[1].row('cpu')['status'] == 'OOM'


def test_eager_maps_over_budget_are_skipped_before_allocating():
    case = Case('ode', 'tiny', 'eager', 1024, 8)
    maps = runner.eager_map_bytes(case, num_heads=3, evals=12, elem_bytes=4, train=False)
    assert maps == 2 * 8 * 3 * 4097 ** 2 * 4
    # inference fits, the training step does not: inference is still timed
    status = runner.precheck(case, 'cpu', 4, do_train=True, budget=maps + 1)
    assert status.startswith('train skipped')
    results = runner.time_interleaved([Case('ode', 'tiny', 'eager', 32, 1), Case('ode', 'tiny', 'ssog', 32, 1)],
                                      1, 0, 'cpu', torch.float32, budget=1)
    assert results[0].status.startswith('skip:') and not results[0].infer_times
    assert results[1].status == 'ok' and results[1].train_times
    assert runner.precheck(Case('ode', 'tiny', 'fused', 4096, 64), 'cpu', 4, True, budget=1) is None


def test_other_errors_are_not_hidden_as_oom(monkeypatch):
    monkeypatch.setattr(Case, 'build', lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError('shape mismatch')))
    with pytest.raises(RuntimeError, match='shape mismatch'):
        runner.time_interleaved([Case('ode', 'tiny', 'ssog', 32, 1)], 1, 0, 'cpu', torch.float32)


@pytest.mark.parametrize('settings,widths,res,match', [
    (['ode'], ['huge'], [224], "Unknown model ssog_ode_huge"),
    (['recurrent'], ['tiny'], [224], 'Unknown depth setting'),
    (['ode'], ['tiny'], [200], 'not divisible by the patch size 16'),
])
def test_bad_configuration(settings, widths, res, match, capsys):
    with pytest.raises(BenchmarkConfigError, match=match):
        validate(settings, widths, res)
    assert main(['--settings', *settings, '--widths', *widths, '--resolutions', *map(str, res)]) == 2
    assert match.split()[0] in capsys.readouterr().err


@pytest.mark.parametrize('args,match', [
    (['--batch-sizes', '1', '0'], 'Batch size 0 is not positive'),
    (['--batch-sizes', '-2'], 'Batch size -2 is not positive'),
    (['--repeats', '0'], '--repeats 0 would time nothing'),
    (['--variants', 'ssog', 'flash'], "Unknown variant 'flash'"),
])
def test_bad_counts_exit_2_with_the_reason(args, match, capsys, tmp_path):
    assert main(['--settings', 'ode', '--resolutions', '32', '--out-dir', str(tmp_path), *args]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / 'benchmark.csv').exists()


def test_plot_only_redraws_from_a_csv(tmp_path):
    rows = [dict(model='m', setting='ode', width='tiny', variant=v, compiled=0, infer_img_size=s, infer_batch_size=1,
                 infer_samples_per_sec=10. * s, infer_mem_mb=s, train_mem_mb=2 * s, infer_gmacs=1., status='ok')
            for v in VARIANTS for s in (32, 64)]
    runner.write_csv(rows, tmp_path / 'in.csv')
    assert main(['--plot-only', str(tmp_path / 'in.csv'), '--out-dir', str(tmp_path), '--prefix', 'again']) == 0
    assert (tmp_path / 'again.png').read_bytes()[:4] == b'\x89PNG'
    assert '| ode | tiny | 64 | 1 | no |' in (tmp_path / 'again.md').read_text()


@pytest.mark.slow
def test_gpu_script_dry_run(tmp_path):
    """The prepared GPU script (issue 59), every section end to end on the CPU at toy sizes, each under its deadline
    (the Triton kernel in Triton's interpreter where Triton is installed): it cannot rot unnoticed."""
    import tarfile
    from timm_odevit.layers.fused_mixer import HAS_TRITON
    out = tmp_path / 'gpu_out'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    proc = subprocess.run(['bash', os.path.join(ROOT, 'benchmarks', 'gpu', 'run.sh'), str(out), '--dry-run'],
                          capture_output=True, text=True, env=env, timeout=1500, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # what a device call brings back: at most 8 files, flat, plain names
    files = sorted(os.listdir(out))
    assert files == ['results.tgz', 'summary.md', 'triton_cache.tgz']
    summary = (out / 'summary.md').read_text()
    assert 'every section passed' in summary.splitlines()[0]
    # the gate's table first, with the Triton kernel's rows where it can run
    parts = summary.split('\n\n')
    assert parts[1] == '## a. correctness gate' and parts[2].startswith('**GATE PASSED** on cpu')
    assert '| float32 | per-head | no | 6 / 6 |' in summary
    assert ('| bfloat16 | triton | yes | 6 / 6 |' in summary) == HAS_TRITON
    titles = re.findall(r'^## (.+)$', summary, flags=re.M)
    assert titles[:2] == ['a. correctness gate', 'sections'] and titles[-1] == 'e. profile'
    sections = re.findall(r'^\| (\w+) \| \d+ \| \d+ \| \d+ \| (.+) \|$', summary, flags=re.M)
    assert [name for name, _ in sections] == ['versions', 'gate', 'tests', 'ops', 'sweep', 'models_1024',
                                              'models_224', 'train_32', 'profile']
    assert all(status == 'ok' for _, status in sections), sections
    assert '| ode | tiny | 64 | 1 | no |' in summary and '| looped | tiny | 32 | 1 | no |' in summary
    assert '| `ssog_vit_tiny_patch4_32` |' in summary and '| `dense_vit_tiny_patch4_32` |' in summary  # training
    assert '| sdpa_flash |' in summary and '(default)' in summary and '### training step' in summary
    with tarfile.open(out / 'results.tgz') as tar:
        tar.extractall(tmp_path / 'back')
    back = tmp_path / 'back'
    assert 'torch' in (back / 'versions.log').read_text()
    assert (back / 'gate.status').read_text() == 'pass\n' and (back / 'profile.txt').is_file()
    ode = _read(back / 'models_1024.csv')
    assert {r['variant'] for r in ode} == set(VARIANTS) | {'ssog_einsum', 'ssog_steer'}
    assert {r['precision'] for r in ode} == {'amp_bfloat16'}
    ops = _read(back / 'ops.csv')
    assert {r['path'] for r in ops if r['ms']} >= {'operator', 'fused', 'accumulate', 'einsum', 'sdpa_flash'} | (
        {'triton'} if HAS_TRITON else set())
    assert {r['dtype'] for r in ops} == {'bfloat16', 'float16'} and {r['backward'] for r in ops} == {'0', '1'}


def _module_from_file(name: str, *path: str):
    """A script or test file of the repository (not a package module) imported as ``name``."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_weights_ema_follows_the_run_length():
    """A tenth of the run as the EMA's horizon: 0.998 (500 steps) was half of the first GPU attempt's runs."""
    ema_decay = _module_from_file('fmnist_weights', 'examples', 'gpu', 'fmnist_weights.py').ema_decay
    assert ema_decay(1170) == pytest.approx(1 - 1 / 117, abs=1e-5)  # 10 epochs at batch 512
    assert ema_decay(14040) == pytest.approx(1 - 1 / 1404, abs=1e-5)  # 120 epochs
    assert ema_decay(100) == 0.99 and ema_decay(10 ** 7) == 0.9999  # clipped at both ends
    assert ema_decay(1170) < ema_decay(14040)


@pytest.mark.slow
def test_gpu_weights_script_dry_run(tmp_path):
    """examples/gpu/fmnist_weights.py end to end on the CPU, one run on the bundled sample: calibration, the epochs
    and EMA decay it fits, the training command, the packed run folder a GPU call brings back."""
    import tarfile
    from timm_odevit_tools.data import SAMPLE_DIR
    out, work = tmp_path / 'out', tmp_path / 'work'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'examples', 'gpu', 'fmnist_weights.py'), str(out),
                           '--data-dir', str(SAMPLE_DIR), '--device', 'cpu', '--dry-run', '--work-dir', str(work),
                           '--only', 'dense_vit_tiny_patch4_32.fmnist',
                           '--train-options', '--train-split test --model-kwargs depth=2'],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'EMA decay 0.99 ' in proc.stdout and 'dense_vit_tiny_patch4_32.fmnist: exit 0' in proc.stdout
    parts = sorted(os.listdir(out))
    assert parts == ['weights_runs.tgz.part0']
    with tarfile.open(out / parts[0]) as tar:
        tar.extractall(tmp_path / 'back')
    run = tmp_path / 'back' / 'dense_vit_tiny_patch4_32.fmnist'
    command = (run / 'command.txt').read_text()
    assert '--model-ema-decay 0.99' in command and '--train-split test' in command and '--epochs 1' in command
    assert 'top1' in (run / 'results.json').read_text()
    state = torch.load(run / 'dense_vit_tiny_patch4_32.fmnist.pth', weights_only=False)
    assert {'state_dict', 'state_dict_ema'} <= set(state)
    assert all(v.dtype == torch.float16 for v in state['state_dict'].values() if v.is_floating_point())


def test_gpu_test_runner_without_pytest_collects_every_cuda_test(monkeypatch):
    """benchmarks/gpu/run_tests.py (used where pytest is missing) sees every test of tests/test_cuda.py and each
    parameter, and skips fixtures."""
    run_tests = _module_from_file('run_tests', 'benchmarks', 'gpu', 'run_tests.py')
    monkeypatch.setitem(sys.modules, 'pytest', run_tests._stand_in_pytest())
    cuda_tests = _module_from_file('cuda_tests', 'tests', 'test_cuda.py')
    counts = {n: len(getattr(f, 'params', [None])) for n, f in vars(cuda_tests).items() if n.startswith('test_')}
    assert counts['test_forward_backward_on_cuda'] == counts['test_forward_without_host_sync'] == len(FAMILIES)
    assert counts['test_allocator_peak_on_cuda_and_accumulate_below_einsum'] == 1
    assert cuda_tests.no_tf32.is_fixture


@pytest.mark.slow
def test_gpu_mixer_check_dry_run(tmp_path):
    """benchmarks/gpu/mixer_check.py, the prepared GPU call of the mixer work, end to end on the CPU at toy sizes:
    every section runs and lands in summary.md, in order."""
    out = tmp_path / 'out'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'gpu', 'mixer_check.py'), str(out),
                           '--dry-run'], capture_output=True, text=True, env=env, timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / 'summary.md').read_text()
    titles = re.findall(r'^## (.+)$', summary, flags=re.M)
    # agreement before timing: the mixing paths' check comes before any timing section
    assert titles == ['versions', 'precision: CUDA against CPU', 'mixing paths', 'kernel profile',
                      'timings: eager, CUDA graphs, reduce-overhead', 'training-step profile']
    assert 'failed' not in summary and '| `ssog_ode_tiny_patch4_32` |' in summary
    assert '| ode | tiny | 32 | 1 | no |' in summary and '| 8x8 | 2 |' in summary
    assert 'images/s' in summary and (out / 'timings_eager.csv').is_file()


def test_gpu_cost_model_prints_every_path_and_backend_at_every_shape():
    import importlib.util
    path = os.path.join(ROOT, 'benchmarks', 'gpu_cost_model.py')
    spec = importlib.util.spec_from_file_location('gpu_cost_model', path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    table = model.table()
    for path in ('sdpa flash', 'sdpa cudnn', 'sdpa memory-efficient', 'fused (per-head matmuls)', 'accumulate',
                 'operator (N x N)', 'triton (one pass)'):
        assert f'| {path} |' in table
    big = model.predictions(4097, 6)
    # the estimate docs/benchmark.md quotes: per-head matmuls a quarter of cuDNN attention at 4097 tokens
    assert big['fused (per-head matmuls)'] < 0.3 * min(v for k, v in big.items() if k.startswith('sdpa'))


def test_op_backward_never_holds_all_heads_k_fold():
    # all heads' K-fold [B, heads, K, H, W, d] intermediates, two of them, would be 8x the values on their own
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'op_memory.py'), '--batch', '1'],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r'forward peak ([\d.]+)x the values; backward peak ([\d.]+)x the values', r.stdout)
    assert m and 0 < float(m[1]) and 0 < float(m[2]) < 6, r.stdout
