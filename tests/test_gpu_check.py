"""The prepared GPU check (benchmarks/gpu/run.sh, the one call a lent GPU runs) without a GPU: its sections' order and deadlines,
a failing or timed-out section failing the run by name, the correctness gate's harness catching a wrong kernel, and
the cost model's per-path prediction. The whole dry run is tests/test_benchmark.py's test_gpu_script_dry_run."""
import importlib.util
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / 'benchmarks' / 'gpu' / 'run.sh'
ORDER = ['versions', 'gate', 'tests', 'ops', 'sweep', 'models_1024', 'models_224', 'train_32', 'profile']


def _module(name: str, *path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT.joinpath(*path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    # the script calls `python`: this interpreter's, whether or not its environment is activated
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get('PATH', '')])
    full = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT), PATH=path, **env)
    return subprocess.run(['bash', str(RUN), str(out), *args], capture_output=True, text=True, env=full, timeout=300)


def _plan(*args: str, **env: str) -> dict:
    proc = _run(Path('unused'), '--plan', *args, **env)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert lines[-1][0] == 'total'
    return {'sections': [(name, int(s)) for name, s in lines[:-1]], 'sum': int(lines[-1][1]),
            'total': int(lines[-1][3])}


def _status_rows(summary: str) -> dict:
    """{section: status} from summary.md's section table."""
    rows = {}
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip('|').split('|')]
        if len(cells) == 5 and cells[0] in ORDER:
            rows[cells[0]] = cells[4]
    return rows


def test_sections_run_in_the_issues_order_within_eight_minutes():
    plan = _plan()
    assert [name for name, _ in plan['sections']] == ORDER  # gate first, then the op, sweep, models, profile
    assert all(budget > 0 for _, budget in plan['sections'])
    # each section's deadline is its own budget; together, and the run's deadline, inside the call's 480 s
    assert plan['sum'] <= plan['total'] <= 470
    dry = _plan('--dry-run')
    assert [name for name, _ in dry['sections']] == ORDER and dry['sum'] <= dry['total']
    assert dict(_plan(GPU_BUDGET_ops='7')['sections'])['ops'] == 7


@pytest.mark.parametrize('argv,says', [(['--plan'], 'OUT_DIR first'), (['OUT', '--bogus'], 'unknown option --bogus')])
def test_an_option_where_the_folder_belongs_is_refused_before_anything_runs(argv, says, tmp_path):
    # the run clears its folder first: an option taken for the folder would have run in the working directory
    proc = subprocess.run(['bash', str(RUN), *argv], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and 'usage:' in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_a_failing_section_fails_the_run_and_is_named(tmp_path):
    out = tmp_path / 'out'
    proc = _run(out, '--dry-run', GPU_RUN_SECTIONS='versions ops', GPU_RUN_INJECT='ops=fail')
    assert proc.returncode != 0, proc.stdout[-2000:]
    summary = (out / 'summary.md').read_text()
    assert summary.splitlines()[0].endswith('FAILED: ops')
    status = _status_rows(summary)
    assert list(status) == ORDER
    assert status['versions'] == 'ok' and status['ops'] == '**FAILED: exit 3**'
    assert status['gate'] == 'not selected'
    # the gate's table opens the summary, whatever ran
    assert summary.split('\n\n')[1] == '## a. correctness gate'
    assert sorted(os.listdir(out)) == ['results.tgz', 'summary.md', 'triton_cache.tgz']
    with tarfile.open(out / 'results.tgz') as tar:
        assert 'injected failure' in tar.extractfile('ops.log').read().decode()
        assert 'torch' in tar.extractfile('versions.log').read().decode()


def test_a_timed_out_section_is_cut_at_its_deadline_and_fails_the_run(tmp_path):
    """A hung section is killed at its own budget; the next one at what is left of the run's deadline; one that
    starts with nothing left is skipped; each is a failure named in summary.md."""
    out = tmp_path / 'out'
    start = time.time()
    proc = _run(out, '--dry-run', GPU_RUN_SECTIONS='sweep models_1024 profile',
                GPU_RUN_INJECT='sweep=hang models_1024=hang profile=hang', GPU_BUDGET_sweep='2',
                GPU_BUDGET_models_1024='100', GPU_BUDGET_profile='100', GPU_RUN_SECONDS='5')
    took = time.time() - start
    assert proc.returncode != 0
    assert took < 60, took  # not the 100 s budgets, nor the hung commands' 100000 s
    status = _status_rows((out / 'summary.md').read_text())
    assert status['sweep'] == '**FAILED: timed out at 2 s**'
    assert status['models_1024'].startswith('**FAILED: timed out at') and status['models_1024'] != \
        '**FAILED: timed out at 100 s**'
    assert status['profile'] == "**FAILED: skipped, the run's 5 s are spent**"
    assert (out / 'summary.md').read_text().splitlines()[0].endswith('FAILED: sweep models_1024 profile')


@pytest.fixture(scope='module')
def check():
    return _module('mixer_check', 'benchmarks', 'gpu', 'mixer_check.py')


def test_gate_reference_is_the_op(check):
    """The gate's einsum reference equals the op's per-head kernel (float64, transposed, prefix tokens)."""
    from timm_odevit.layers.fused_mixer import separable_mix_by_head
    torch.manual_seed(0)
    factors = [f.detach().double() for f in check._factors(2, 4, 5, 3, 'cpu', 0)]
    v = torch.randn(2, 3 + 15, 16, dtype=torch.float64)
    for transpose in (False, True):
        torch.testing.assert_close(check.reference_mix(v, *factors, 5, 3, transpose),
                                   separable_mix_by_head(v, *factors, 5, 3, True, transpose))


def test_gate_catches_a_wrong_kernel(check, monkeypatch):
    fwd, grads = check.gate_case('per-head', torch.float32, True, (5, 3), 1, 2, 2, 8, 'cpu')
    tol, grad_tol = check.GATE_TOLERANCE['float32']
    assert fwd < tol and max(grads.values()) < grad_tol and set(grads) == set(check.GATE_GRADS)
    real = check.separable_mix

    def off_by_one_percent(*args, **kwargs):
        return real(*args, **kwargs) * 1.01
    monkeypatch.setattr(check, 'separable_mix', off_by_one_percent)
    fwd, grads = check.gate_case('per-head', torch.float32, True, (5, 3), 1, 2, 2, 8, 'cpu')
    assert fwd > 10 * tol and grads['v'] > grad_tol


def test_triton_timings_wait_for_the_gate(check, tmp_path):
    args = SimpleNamespace(out=tmp_path, dry_run=True, device='cpu')
    assert not check.gate_passed(tmp_path)
    assert check.sweep(args).startswith('skipped: the gate did not pass')
    (tmp_path / 'gate.status').write_text('fail\n')
    assert not check.gate_passed(tmp_path)
    (tmp_path / 'gate.status').write_text('pass\n')
    assert check.gate_passed(tmp_path)


def test_a_failed_section_exits_non_zero_with_its_report(check, tmp_path, monkeypatch):
    def broken(args):
        raise check.SectionFailed('found a difference')
    monkeypatch.setitem(check.RUN_SECTIONS, 'gate', broken)
    assert check.main([str(tmp_path), '--dry-run', '--section', 'gate']) == 1
    assert (tmp_path / 'gate.md').read_text().startswith('found a difference')


def test_cost_model_predicts_by_the_checks_path_names():
    model = _module('gpu_cost_model', 'benchmarks', 'gpu_cost_model.py')
    table = model.predictions(4097, 6)
    for path, name in model.PATH_NAMES.items():
        assert model.predict(path, 4097, 6) == table[name]
    assert model.predict('sdpa_flash', 197, 3, dtype='float16') == model.predictions(197, 3)['sdpa flash']
    assert model.predict('einsum', 4097, 6) is None  # no figure: the einsum path, a backward, float32
    assert model.predict('fused', 4097, 6, backward=True) is None
    assert model.predict('fused', 4097, 6, dtype='float32') is None
    # batch and head dim are the model's inputs, not constants
    assert model.predict('operator', 1025, 3, batch=64) > model.predict('operator', 1025, 3)


def test_the_stand_in_runner_counts_a_skip_as_a_skip(monkeypatch):
    run_tests = _module('run_tests', 'benchmarks', 'gpu', 'run_tests.py')
    stand_in = run_tests._stand_in_pytest()
    with pytest.raises(run_tests.Skipped):
        stand_in.skip('Triton is not installed')
