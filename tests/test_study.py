"""The matched study end to end on a tiny budget: runs (resume, locks, recipe guard), report, elasticity, export;
the train.py YAML recipes (committed files current, every key a train.py option, every model builds)."""
import csv
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import timm
import timm_odevit  # noqa: F401
from timm_odevit_tools import data as fm
from timm_odevit_tools.evaluate import evaluate, parse_solver
from timm_odevit.models.families import FAMILIES
from timm_odevit.models.pretrained import FMNIST_CFG
from experiments.study import STUDY_PAIRS, StudyRecipe, run_study, study_runs
from experiments.study.elasticity import write_elasticity
from experiments.study.export import best_runs, export_run
from experiments.study.guidance import (check_teacher, guidance_report, guidance_runs, guidance_setup,
                                       guidance_variants, write_guidance_report)
from experiments.study.recipes import write_recipes
from timm_odevit_tools.train import read_checkpoint
from experiments.study.report import write_report
from experiments.study.runs import _claim, is_done, run_dir, train_command
from tiers import slow_except

REPO = Path(__file__).resolve().parent.parent
TINY = StudyRecipe(train_samples=48, val_samples=32, epochs=2, batch_size=16)


def test_study_runs_are_matched_pairs_seed_major():
    runs = study_runs((0, 1))
    assert len(runs) == 12 and [r.seed for r in runs] == [0] * 6 + [1] * 6
    for setting, (dense, ssog, kwargs) in STUDY_PAIRS.items():
        pair = [r for r in runs[:6] if r.setting == setting]
        assert [r.arch for r in pair] == [dense, ssog]
        assert all(r.model_kwargs == tuple(f'{k}={v}' for k, v in kwargs.items()) for r in pair)
    # the ODE setting is not the looped trunk again: it is solved on a finer grid
    assert STUDY_PAIRS['ode'].model_kwargs['ode_steps'] != 12
    with pytest.raises(ValueError, match='Unknown setting'):
        study_runs((0,), ['recurrent'])


@pytest.fixture(scope='module')
def idx_folder(tmp_path_factory):
    """Fashion-MNIST IDX files with a train split: the bundled sample's images serve as both splits."""
    d = tmp_path_factory.mktemp('fmnist')
    for split in ('train', 't10k'):
        for kind in ('images-idx3-ubyte', 'labels-idx1-ubyte'):
            shutil.copy(fm.SAMPLE_DIR / f't10k-{kind}.gz', d / f'{split}-{kind}.gz')
    return d


@pytest.fixture(scope='module')
def study(idx_folder, tmp_path_factory):
    """The ODE pair trained for 2 epochs on 48 images (one subprocess each, as the real study runs)."""
    root = tmp_path_factory.mktemp('study')
    home = tmp_path_factory.mktemp('home')  # the dataset cache lives under $HOME/.cache
    old = os.environ.get('HOME')
    os.environ['HOME'] = str(home)
    try:
        runs = study_runs((0,), ['ode'])
        statuses = [s for _, s in run_study(root, runs, TINY, data_dir=str(idx_folder))]
    finally:
        os.environ['HOME'] = old or ''
    return root, runs, statuses


@pytest.mark.slow
def test_runs_train_log_and_resume(study):
    root, runs, statuses = study
    assert statuses == ['trained', 'trained']
    for run in runs:
        d = run_dir(root, run)
        with open(d / 'summary.csv') as f:
            assert [int(r['epoch']) for r in csv.DictReader(f)] == [0, 1]
        args = vars(read_checkpoint(str(d / 'last.pth.tar'))['args'])
        assert args['model_kwargs'] == {'ode_steps': 23} and args['in_chans'] == 1
        assert (d / 'command.txt').read_text().startswith('python -m timm_odevit_tools.train --model')
    # a second pass trains nothing: every run is done
    assert [s for _, s in run_study(root, runs, TINY)] == ['already done', 'already done']


def test_locks_and_recipe_guard(study, tmp_path):
    root, runs, _ = study
    with pytest.raises(ValueError, match='another --out-dir'):
        next(run_study(root, runs, StudyRecipe(train_samples=99)))
    fresh = tmp_path / 'other'
    assert _claim(fresh, runs[0])          # this process holds it now
    assert not _claim(fresh, runs[0])      # a second runner skips it
    (fresh / 'runs' / f'{runs[1].name}.lock').write_text('999999999')  # a dead runner's lock
    assert _claim(fresh, runs[1])
    assert not is_done(fresh, runs[0])


def test_report_table_and_curves(study):
    root, runs, _ = study
    table = write_report(root)
    rows = list(csv.DictReader(open(root / 'results.csv')))
    top1 = {r['arch']: float(r['val_top1']) for r in rows}
    final = {run.arch: json.loads((run_dir(root, run) / 'results.json').read_text())['top1'] for run in runs}
    assert top1 == pytest.approx({k: round(v, 2) for k, v in final.items()})
    dense, ssog, _ = STUDY_PAIRS['ode']
    gain = top1[ssog] - top1[dense]
    assert f'{gain:.2f} (1 run)' in table and '+2.2 to +4.1' in table
    assert (root / 'curves.png').stat().st_size > 10_000


def test_elasticity_grid_and_nfe(study):
    root, _, _ = study
    table = write_elasticity(root, ['euler:3', 'euler:23', 'rk4:3'], test_samples=64)
    rows = list(csv.DictReader(open(root / 'elasticity.csv')))
    assert {(r['method'], int(r['steps']), int(r['nfe'])) for r in rows} == {('euler', 3, 3), ('euler', 23, 23),
                                                                            ('rk4', 3, 12)}
    assert '| NFE | | 3 | 23 | 12 |' in table and (root / 'elasticity.png').is_file()
    with pytest.raises(ValueError, match='method:steps'):
        parse_solver('euler')


@pytest.mark.slow
def test_export_card_carries_measured_top1(study, tmp_path, sample_first_100):
    root, runs, _ = study
    best = best_runs(root)
    assert set(best) == {r.arch for r in runs}
    arch = STUDY_PAIRS['ode'].ssog
    out = export_run(best[arch], 'test', FMNIST_CFG, str(tmp_path), 'a test export', full_test=False)
    repo = tmp_path / f'{arch}.test'
    model = timm.create_model(f'local-dir:{repo}', pretrained=True)
    r = evaluate(model, fm.load_tensors(fm.SAMPLE_DIR, 'test', model=model))
    card = (repo / 'README.md').read_text()
    assert out['Fashion-MNIST sample (1,000 test images, bundled)'] == r['top1']
    assert r['n'] == 100 and f'top-1 {r["top1"]:.2f}% ({r["correct"]}/100)' in card
    # solved as trained (what pretrained=True gives), and at the architecture's default 12 steps too
    assert model.trunk.steps == 23 and '**ODE solver:** euler, 23 steps' in card and '--solver euler:12' in card
    # the card's command is the training command's, with the run's non-default options
    command = next(line for line in card.splitlines() if 'python -m timm_odevit_tools.train' in line)
    assert 'python -m timm_odevit_tools.train --model ssog_ode_tiny_patch4_32 --model-kwargs ode_steps=23' in command
    assert '--train-samples 48' in command and '--output' not in command and '--data-dir' not in command
    # the budget: images seen, wall time from the run's results.json, threads and precision
    budget = next(line for line in card.splitlines() if 'images seen' in line)
    history = json.loads((Path(best[arch]) / 'results.json').read_text())['history']
    epochs = len(history)
    assert f'{48 * epochs} images seen ({epochs} epochs of 48)' in budget
    minutes = sum(h['train_seconds'] for h in history) / 60
    assert f'{minutes:.1f} min of training steps' in budget and 'CPU thread(s), fp32' in budget


GUIDANCE = dict(student='odevit_tiny_patch4_32', teacher='dense_vit_tiny_patch4_32 --teacher-kwargs depth=2 in_chans=1',
                guide='--state-norm layernorm', model_kwargs=('depth=2',))


def test_guidance_runs_pair_the_arms_seed_major():
    setup = guidance_setup(**GUIDANCE)
    runs = guidance_runs(setup, (0, 1))
    assert [(r.arm, r.seed) for r in runs] == [('scratch', 0), ('guided', 0), ('scratch', 1), ('guided', 1)]
    assert [r.name for r in runs[:2]] == ['odevit_tiny_patch4_32-scratch-seed0', 'odevit_tiny_patch4_32-guided-seed0']
    scratch, guided = (train_command(Path('root'), r, TINY) for r in runs[:2])
    assert '--teacher' not in scratch and '--state-norm' not in scratch
    assert guided[guided.index('--teacher'):guided.index('--teacher') + 5] == \
        ['--teacher', 'dense_vit_tiny_patch4_32', '--teacher-kwargs', 'depth=2', 'in_chans=1']
    assert guided[guided.index('--state-norm') + 1] == 'layernorm'
    assert scratch[scratch.index('--model-kwargs') + 1] == guided[guided.index('--model-kwargs') + 1] == 'depth=2'
    with pytest.raises(ValueError, match='needs a teacher'):
        guidance_setup('odevit_tiny_patch4_32', ' ')


def test_guidance_train_options_reach_both_arms():
    """--train-options (e.g. the published weights' augmentation and EMA) go to both arms; options that the recipe,
    the runner or the guided arm owns are refused, abbreviated or not."""
    setup = guidance_setup(**GUIDANCE, train_options='--augment --smoothing 0.1 --model-ema')
    for run in guidance_runs(setup, (0,)):
        cmd = train_command(Path('root'), run, TINY)
        assert '--augment' in cmd and cmd[cmd.index('--smoothing') + 1] == '0.1' and '--model-ema' in cmd
    assert 'train_options' not in guidance_setup(**GUIDANCE)  # a study.json written without them still matches
    for bad, name in (('--epochs 3', 'epochs'), ('--epo 3', 'epochs'), ('--seed 1', 'seed'),
                      ('--state-norm cosine', 'state_norm'), ('--teacher dense_vit_tiny', 'teacher')):
        with pytest.raises(ValueError, match=f"sets \\['{name}'\\]"):
            guidance_setup(**GUIDANCE, train_options=bad)
    with pytest.raises(ValueError, match='not an option list'):
        guidance_setup(**GUIDANCE, train_options='--no-such-option')


@pytest.fixture(scope='module')
def guidance(idx_folder, tmp_path_factory):
    """Scratch and guided (a random 2-block teacher) for 2 seeds, 2 epochs on 48 images, as subprocesses."""
    root = tmp_path_factory.mktemp('guidance')
    home = tmp_path_factory.mktemp('home')
    old = os.environ.get('HOME')
    os.environ['HOME'] = str(home)
    try:
        setup = guidance_setup(**GUIDANCE)
        statuses = [s for _, s in run_study(root, guidance_runs(setup, (0, 1)), TINY, data_dir=str(idx_folder),
                                            setup=setup)]
    finally:
        os.environ['HOME'] = old or ''
    return root, setup, statuses


@pytest.mark.slow
def test_guidance_report_pairs_seeds_and_reads_the_trajectory(guidance, idx_folder):
    root, setup, statuses = guidance
    assert statuses == ['trained'] * 4
    top1 = {(arm, seed): json.loads((root / 'runs' / f'odevit_tiny_patch4_32-{arm}-seed{seed}' / 'results.json')
                                    .read_text())['top1'] for arm in ('scratch', 'guided') for seed in (0, 1)}
    ckpt = read_checkpoint(str(root / 'runs' / 'odevit_tiny_patch4_32-guided-seed0' / 'last.pth.tar'))
    assert vars(ckpt['args'])['state_norm'] == 'layernorm' and len(ckpt['task_state']['target_times']) == 2
    assert 'task_state' not in read_checkpoint(str(root / 'runs' / 'odevit_tiny_patch4_32-scratch-seed0' /
                                                   'last.pth.tar'))
    table = write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))
    gains = [top1['guided', k] - top1['scratch', k] for k in (0, 1)]
    assert f'{sum(gains) / 2:.2f} ± ' in table and '> +10' in table and '`--state-norm layernorm`' in table
    assert 'training min per run, scratch / guided' in table
    rows = list(csv.reader(open(root / 'guidance.csv')))
    assert rows[0][:4] == ['arm', 'seed', 'top1', 'images'] and len(rows[0]) == 6 and len(rows) == 5
    assert {r[3] for r in rows[1:]} == {'32'} and 'on the first 32 test images' in table
    gaps = [float(v) for r in rows[1:] for v in r[4:]]
    assert all(0 < g <= 2 for g in gaps)
    # the arms differ in their trajectories, and guided runs train a different student than scratch ones
    assert [r[4:] for r in rows[1:3]] != [r[4:] for r in rows[3:5]]
    # the page is rendered from the data the folder holds: without the checkpoints, the same page
    assert guidance_report(root) == table == (root / 'guidance.md').read_text()
    with pytest.raises(ValueError, match='another --out-dir'):
        next(run_study(root, guidance_runs(setup, (0,)), TINY, setup=dict(setup, guide='--state-norm cosine')))


def test_guidance_report_keeps_the_committed_trajectory_of_runs_without_checkpoints(guidance, idx_folder, tmp_path):
    """Checkpoints are not committed: measured again elsewhere, the report keeps the trajectory an earlier report
    wrote for a run whose checkpoint is gone, names a run it has no trajectory for instead of failing, and renders
    from the committed data alone (guidance_report) what the measuring report wrote."""
    root = tmp_path / 'guidance'
    shutil.copytree(guidance[0], root)
    # the fixture's teacher is random, built anew by each report: the same seed gives the same one
    torch.manual_seed(0)
    write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))
    before = list(csv.reader(open(root / 'guidance.csv')))
    (root / 'runs' / 'odevit_tiny_patch4_32-scratch-seed1' / 'last.pth.tar').unlink()
    torch.manual_seed(0)
    table = write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))
    assert list(csv.reader(open(root / 'guidance.csv'))) == before and guidance_report(root) == table
    (root / 'guidance.csv').unlink()
    torch.manual_seed(0)
    table = write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))
    rows = {(r[0], r[1]): r[4:] for r in csv.reader(open(root / 'guidance.csv'))}
    kept = next(r[4:] for r in before if r[:2] == ['scratch', '0'])
    assert rows['scratch', '1'] == [] and rows['scratch', '0'] == kept
    assert 'without scratch seed 1 (no trajectory measured)' in table and guidance_report(root) == table
    kept_rows = list(csv.reader(open(root / 'guidance.csv')))
    for path in (root / 'runs').glob('*/last.pth.tar'):
        path.unlink()
    table = write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))
    assert list(csv.reader(open(root / 'guidance.csv'))) == kept_rows and guidance_report(root) == table
    (root / 'guidance.csv').unlink()
    with pytest.raises(FileNotFoundError, match='no guided checkpoint'):
        write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))
    with pytest.raises(FileNotFoundError, match='guidance.csv is missing'):
        guidance_report(root)
    (root / 'guidance.csv').write_text('arm,seed,top1,gap_t1.0\r\nscratch,0,50.0,0.5\r\n')
    with pytest.raises(ValueError, match='does not start with the columns arm, seed, top1, images'):
        guidance_report(root)


@pytest.mark.slow
def test_guidance_report_full_test_per_seed_on_grid_and_registered_solver(guidance, idx_folder, tmp_path):
    """--full-test: each run's last-epoch weights on the whole test split, at the registered solver and on the
    training grid, cached in the run's full_test.json so that the table survives the checkpoints."""
    root = tmp_path / 'guidance'
    shutil.copytree(guidance[0], root)
    meta = json.loads((root / 'study.json').read_text())
    # a solver option of the shared model kwargs: the same weights, solved on a 3-step grid instead of the 2 steps
    # the registered solver gives a depth-2 trunk
    meta['setup']['model_kwargs'] = ['depth=2', 'ode_steps=3']
    (root / 'study.json').write_text(json.dumps(meta))
    torch.manual_seed(0)
    assert 'whole test set' not in write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))
    torch.manual_seed(0)
    table = write_guidance_report(root, test_samples=32, data_dir=str(idx_folder), full_test=True)
    assert '| seed | scratch, euler:3 (training grid) | guided, euler:3 (training grid) | gain (points) | ' \
           'scratch, euler:2 (registered) |' in table
    run = root / 'runs' / 'odevit_tiny_patch4_32-guided-seed1'
    measured = json.loads((run / 'full_test.json').read_text())
    model = timm.create_model('odevit_tiny_patch4_32', depth=2, in_chans=1, img_size=32,
                              pretrained_cfg_overlay=FMNIST_CFG)
    model.load_state_dict(read_checkpoint(str(run / 'last.pth.tar'))['state_dict'])
    images = fm.load_tensors(str(idx_folder), 'test', model=model)
    n = len(images[1])
    assert f'whole test set ({n:,} images)' in table
    assert measured['registered'] == {'solver': 'euler:2', 'top1': round(evaluate(model, images)['top1'], 2)}
    model.set_solver(steps=3)
    assert measured['grid'] == {'solver': 'euler:3', 'top1': round(evaluate(model, images)['top1'], 2)}
    rows = [ln for ln in table.splitlines() if ln.startswith('| 1 |') or ln.startswith('| mean ± SD |')]
    grid = {arm: json.loads((root / 'runs' / f'odevit_tiny_patch4_32-{arm}-seed1' / 'full_test.json').read_text())
            ['grid']['top1'] for arm in ('scratch', 'guided')}
    assert rows[0].startswith(f'| 1 | {grid["scratch"]:.2f} | {grid["guided"]:.2f} | '
                              f'{grid["guided"] - grid["scratch"]:+.2f} |') and len(rows) == 2
    # checkpoints gone (a fresh clone): the committed files give the same table
    for path in (root / 'runs').glob('*/last.pth.tar'):
        path.unlink()
    again = write_guidance_report(root, test_samples=32, data_dir=str(idx_folder), full_test=True)
    assert again.split('whole test set')[1] == table.split('whole test set')[1]
    # runs measured unalike are refused, not averaged
    (run / 'full_test.json').write_text(json.dumps(dict(measured, images=n + 1)))
    with pytest.raises(ValueError, match='differ in images or solvers'):
        write_guidance_report(root, test_samples=32, data_dir=str(idx_folder))


@pytest.mark.slow
def test_guidance_runner_measures_each_run_on_the_full_test_as_it_ends(guidance, idx_folder, tmp_path):
    """The command's runner writes each run's full_test.json while its checkpoint is still there, so that a
    checkpoint lost with a machine leaves the run in the full-test table; the file holds what the report measures."""
    from experiments.study.__main__ import main
    from experiments.study.guidance import record_full_test
    root = tmp_path / 'guidance'
    shutil.copytree(guidance[0], root)
    meta = json.loads((root / 'study.json').read_text())
    recipe = [f'--{k.replace("_", "-")}={v}' for k, v in meta['recipe'].items()]
    assert main(['guidance', '--out-dir', str(root), '--seeds', '0', '2', '--data-dir', str(idx_folder),
                 '--student', GUIDANCE['student'], '--teacher', GUIDANCE['teacher'], '--guide', GUIDANCE['guide'],
                 '--model-kwargs', *GUIDANCE['model_kwargs'], *recipe]) == 0
    runs = root / 'runs'
    # seed 0 was done before: not trained, not measured
    assert not list(runs.glob('*-seed0/full_test.json'))
    for arm in ('scratch', 'guided'):
        run = runs / f'odevit_tiny_patch4_32-{arm}-seed2'
        written = json.loads((run / 'full_test.json').read_text())
        assert written['registered']['solver'] == 'euler:2' and 'grid' not in written
        assert record_full_test(run, meta['setup'], str(idx_folder)) == written


@pytest.mark.slow
def test_guided_run_records_and_cards_its_guidance(guidance, tmp_path):
    """A guided run's results.json holds its guidance with the defaults resolved (attention, JaSMin and logit KD on
    for an attention student and a same-label teacher); its exported card names the teacher, the student times of
    its targets and each loss weight, and says it was guided; a scratch run's card has no teacher line."""
    from timm_odevit_tools.hub.export import export_checkpoint
    root, _, _ = guidance
    run = root / 'runs' / 'odevit_tiny_patch4_32-guided-seed0'
    recorded = json.loads((run / 'results.json').read_text())['guidance']
    times = read_checkpoint(str(run / 'last.pth.tar'))['task_state']['target_times'].tolist()
    assert recorded['times'] == pytest.approx(times) and recorded['state_norm'] == 'layernorm'
    assert recorded['weights'] == {'label': 1., 'state': 0.5, 'attention': 0.25, 'logit_kd': 1., 'jasmin': 1.}
    assert 'cls_token' in recorded['copied_from_teacher'] and not recorded['copied_frozen']
    export_checkpoint(str(run / 'last.pth.tar'), 'guided', str(tmp_path), FMNIST_CFG, full_test=False)
    card = (tmp_path / 'odevit_tiny_patch4_32.guided' / 'README.md').read_text()
    line = next(x for x in card.splitlines() if 'teacher guidance' in x)
    assert 'teacher `dense_vit_tiny_patch4_32`, kwargs depth=2 in_chans=1' in line
    assert f'2 targets (teacher blocks: all) at student times {times[0]:g}, {times[1]:g} (rule uniform)' in line
    assert ('loss = 1 x label loss + 0.5 x CLS state MSE (state norm layernorm) + 0.25 x CLS attention L1 + 1 x logit '
            'KD (T=1) + 1 x JaSMin (k=2)') in line
    assert 'teacher terms at full weight throughout' in line and 'initialised from the teacher: ' in line
    assert 'guided by a teacher' in card
    export_checkpoint(str(root / 'runs' / 'odevit_tiny_patch4_32-scratch-seed0' / 'last.pth.tar'), 'scratch',
                      str(tmp_path), FMNIST_CFG, full_test=False)
    card = (tmp_path / 'odevit_tiny_patch4_32.scratch' / 'README.md').read_text()
    assert 'teacher guidance' not in card and 'trained from scratch' in card


def test_guidance_report_needs_both_arms(tmp_path):
    (tmp_path / 'runs' / 'odevit_tiny_patch4_32-scratch-seed0').mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match='both arms'):
        write_guidance_report(tmp_path)


def test_guidance_variants_compare_guided_arms_of_one_setup(tmp_path):
    """Variants of one comparison side by side, from the committed logs alone; a folder with another teacher or
    recipe is refused, not put in the same table."""
    variant = tmp_path / 'variant'
    shutil.copytree(REPO / 'results' / 'guidance', variant, ignore=shutil.ignore_patterns('*.pth.tar'))
    meta = json.loads((variant / 'study.json').read_text())
    meta['setup']['guide'] = '--state-norm cosine'
    (variant / 'study.json').write_text(json.dumps(meta))
    for seed, top1 in ((0, 90.0), (1, 91.5)):
        result = variant / 'runs' / f'odevit_tiny_patch4_32-guided-seed{seed}' / 'results.json'
        result.write_text(json.dumps(dict(json.loads(result.read_text()), top1=top1)))
    scratch = [json.loads((variant / 'runs' / f'odevit_tiny_patch4_32-scratch-seed{k}' / 'results.json').read_text())
               ['top1'] for k in (0, 1)]
    rows = guidance_variants([REPO / 'results' / 'guidance', variant]).splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith('| `--state-norm layernorm` |'), rows
    gain = (90.0 - scratch[0] + 91.5 - scratch[1]) / 2
    assert rows[1].startswith('| `--state-norm cosine` |') and f'| 90.75 ± 1.06 | {gain:.2f} ± ' in rows[1], rows
    meta['recipe']['epochs'] = 2
    (variant / 'study.json').write_text(json.dumps(meta))
    with pytest.raises(ValueError, match='another student, teacher or recipe'):
        guidance_variants([REPO / 'results' / 'guidance', variant])


def _guided_run_with_teacher(root: Path, seed: int, teacher_bytes: bytes) -> None:
    run = root / 'runs' / f'odevit_tiny_patch4_32-guided-seed{seed}'
    run.mkdir(parents=True)
    recorded = hashlib.sha256(teacher_bytes).hexdigest()
    (run / 'results.json').write_text(json.dumps({'top1': 80.0, 'history': [], 'teacher_checkpoint_sha256': recorded}))


def test_guidance_refuses_a_teacher_file_that_changed_under_its_runs(tmp_path):
    """A comparison names its teacher by path; when that path comes to hold another weight (a published weight
    trained further), more guided runs in the same folder, by the runner or its command line, are refused by name."""
    from experiments.study.__main__ import main as study_main
    teacher = tmp_path / 'teacher.safetensors'
    teacher.write_bytes(b'first teacher')
    option = f'dense_vit_tiny_patch4_32 --teacher-checkpoint {teacher} --teacher-kwargs in_chans=1'
    root = tmp_path / 'comparison'
    check_teacher(root, option)  # nothing finished yet: nothing to compare with
    _guided_run_with_teacher(root, 0, b'first teacher')
    check_teacher(root, option)
    check_teacher(root, 'hf-hub:timm-odevit/dense_vit_tiny_patch4_32.fmnist')  # not a local file: not checked
    teacher.write_bytes(b'trained further')
    with pytest.raises(ValueError, match='is not the teacher the finished guided runs .* has changed since'):
        check_teacher(root, option)
    with pytest.raises(ValueError, match='has changed since'):
        check_teacher(root, f'dense_vit_tiny_patch4_32 --teacher-checkpoint={teacher}')
    with pytest.raises(ValueError, match='has changed since'):
        study_main(['guidance', '--out-dir', str(root), '--teacher', option, '--seeds', '0', '--epochs', '1'])
    assert not (root / 'study.json').exists()  # refused before anything was written or trained


def test_guidance_variants_refuse_folders_guided_by_different_teacher_files(tmp_path):
    """Same teacher option string, different weights in the file: not variants of one comparison."""
    base, other = tmp_path / 'base', tmp_path / 'other'
    for root, teacher in ((base, b'first teacher'), (other, b'trained further')):
        shutil.copytree(REPO / 'results' / 'guidance', root, ignore=shutil.ignore_patterns('*.pth.tar'))
        for seed in (0, 1):
            result = root / 'runs' / f'odevit_tiny_patch4_32-guided-seed{seed}' / 'results.json'
            recorded = hashlib.sha256(teacher).hexdigest()
            result.write_text(json.dumps(dict(json.loads(result.read_text()), teacher_checkpoint_sha256=recorded)))
    assert len(guidance_variants([base, base]).splitlines()) == 4
    with pytest.raises(ValueError, match='another student, teacher or recipe'):
        guidance_variants([base, other])
    with pytest.raises(ValueError, match='another student, teacher or recipe'):
        guidance_variants([REPO / 'results' / 'guidance', base])  # runs from before the record: not the same either


def test_committed_recipes_are_current(tmp_path):
    written = write_recipes(tmp_path)
    assert len(written) == 2 * len(FAMILIES) == 14
    for path in written:
        committed = REPO / 'examples' / path.name
        assert committed.is_file(), f'{committed} missing: run python -m experiments.study recipes'
        assert committed.read_text() == path.read_text(), f'{committed} is stale: python -m experiments.study recipes'


@pytest.mark.parametrize('name', slow_except(sorted(p.name for p in (REPO / 'examples').glob('*.yaml')),
                                              fast=lambda n: n.startswith('fmnist')))
def test_recipe_keys_are_train_py_options_and_model_builds(name):
    dests = set((REPO / 'tests' / 'data' / 'timm_train_py_dests.txt').read_text().split())
    cfg = yaml.safe_load((REPO / 'examples' / name).read_text())
    assert set(cfg) <= dests, set(cfg) - dests
    assert len(cfg['mean']) == len(cfg['std']) == cfg.get('in_chans', 3)
    model = timm.create_model(cfg['model'], num_classes=cfg['num_classes'], in_chans=cfg.get('in_chans', 3),
                              img_size=cfg['img_size'], **cfg.get('model_kwargs', {}))
    if cfg['img_size'] <= 32:  # the 224-px models are covered by timm's own test suite
        with torch.no_grad():
            out = model(torch.randn(2, cfg.get('in_chans', 3), cfg['img_size'], cfg['img_size']))
        assert out.shape == (2, cfg['num_classes'])
