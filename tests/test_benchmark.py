"""The benchmark harness on tiny configurations: outputs, ratios, memory in a child, OOM and bad input. No speed is
asserted: speed and memory are what the benchmark reports, not what tests check."""
import csv
import subprocess

import pytest
import torch

from timm_odevit.benchmark import runner
from timm_odevit.benchmark.__main__ import main
from timm_odevit.benchmark.runner import CSV_COLUMNS, BenchmarkConfigError, Case, ratio_rows, validate


def test_end_to_end_outputs(tmp_path, capsys):
    rc = main(['--settings', 'ode', '--widths', 'tiny', '--resolutions', '32', '48', '--repeats', '1',
               '--batch-size', '1', '--out-dir', str(tmp_path)])
    assert rc == 0
    with open(tmp_path / 'benchmark.csv') as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == CSV_COLUMNS
    assert {r['variant'] for r in rows} == {'ssog', 'dense', 'floor'}
    assert {r['infer_img_size'] for r in rows} == {'32', '48'}
    for r in rows:
        assert r['status'] == 'ok'
        assert float(r['infer_samples_per_sec']) > 0 and float(r['train_samples_per_sec']) > 0
        assert float(r['infer_gmacs']) > 0 and float(r['param_count']) > 0
        assert int(r['nfe']) == 12
        assert r['infer_mem_mb'] != '' and r['train_mem_mb'] != ''
    # same model family differs only in the mixer: the floor has the fewest MACs, dense the most at equal size
    by_variant = {(r['variant'], r['infer_img_size']): float(r['infer_gmacs']) for r in rows}
    assert by_variant[('floor', '48')] < by_variant[('ssog', '48')] < by_variant[('dense', '48')]
    png = (tmp_path / 'benchmark.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n'
    md = (tmp_path / 'benchmark.md').read_text()
    assert '| ode | tiny | 32 |' in md and '| ode | tiny | 48 |' in md
    assert 'infer SSoG/dense' in capsys.readouterr().out


def test_ratio_computation():
    def row(variant, ips, tps, mem):
        return dict(setting='ode', width='tiny', variant=variant, infer_img_size=224, infer_samples_per_sec=ips,
                    train_samples_per_sec=tps, infer_mem_mb=mem, train_mem_mb=mem and 2 * mem)
    ratios = ratio_rows([row('ssog', 30., 9., 40.), row('dense', 10., 3., 100.), row('floor', 36., 12., 30.)])
    assert len(ratios) == 1
    r = ratios[0]
    assert r['infer_speedup'] == pytest.approx(3.0) and r['train_speedup'] == pytest.approx(3.0)
    assert r['infer_mem_saving'] == pytest.approx(60.0) and r['train_mem_saving'] == pytest.approx(60.0)
    assert r['infer_cost_over_floor'] == pytest.approx(1.2) and r['train_cost_over_floor'] == pytest.approx(12 / 9)
    # a missing (OOM) dense side gives no ratio instead of a wrong one
    oom = ratio_rows([row('ssog', 30., 9., 40.), dict(row('dense', None, None, None), status='OOM')])[0]
    assert oom['infer_speedup'] is None and oom['infer_mem_saving'] is None


def test_memory_measured_in_fresh_child():
    case = Case('looped', 'tiny', 'dense', 64, 2)
    status, mem = runner.measure_memory(case, 'cpu', torch.float32)
    assert status == 'ok'
    assert mem['infer'] > 0 and mem['train'] > mem['infer']


def test_child_killed_is_reported_as_oom(monkeypatch):
    monkeypatch.setattr(runner.subprocess, 'run',
                        lambda *a, **k: subprocess.CompletedProcess(a, -9, stdout='', stderr=''))
    assert runner.measure_memory(Case('ode', 'tiny', 'ssog', 32, 1), 'cpu', torch.float32) == ('OOM', {})


def test_oom_marks_the_case_and_the_run_goes_on(monkeypatch):
    real_build = Case.build

    def build(self, *args, **kwargs):
        if self.variant == 'dense':
            raise RuntimeError('[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can\'t allocate memory')
        return real_build(self, *args, **kwargs)

    monkeypatch.setattr(Case, 'build', build)
    cases = [Case('ode', 'tiny', v, 32, 1) for v in runner.VARIANTS]
    results = runner.time_interleaved(cases, repeats=1, warmup=0, device='cpu', dtype=torch.float32)
    assert [r.status for r in results] == ['ok', 'OOM', 'ok']
    assert results[0].infer_times and results[2].train_times and not results[1].infer_times
    assert results[1].row('cpu')['status'] == 'OOM'


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
