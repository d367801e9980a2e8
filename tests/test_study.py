"""The matched study end to end on a tiny budget: runs (resume, locks, recipe guard), report, elasticity, export;
the train.py YAML recipes (committed files current, every key a train.py option, every model builds)."""
import csv
import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import timm
import timm_odevit  # noqa: F401
from timm_odevit import data as fm
from timm_odevit.hub.recipe import evaluate
from timm_odevit.models.pretrained import FMNIST_CFG
from timm_odevit.study import SETTINGS, StudyRecipe, run_study, study_runs
from timm_odevit.study.elasticity import parse_solver, write_elasticity
from timm_odevit.study.export import best_runs, export_run
from timm_odevit.study.recipes import FAMILIES, write_recipes
from timm_odevit.study.report import write_report
from timm_odevit.study.runs import _claim, is_done, run_dir

REPO = Path(__file__).resolve().parent.parent
TINY = StudyRecipe(train_samples=48, val_samples=32, epochs=2, batch_size=16)


def test_study_runs_are_matched_pairs_seed_major():
    runs = study_runs((0, 1))
    assert len(runs) == 12 and [r.seed for r in runs] == [0] * 6 + [1] * 6
    for setting, (dense, ssog, kwargs) in SETTINGS.items():
        pair = [r for r in runs[:6] if r.setting == setting]
        assert [r.arch for r in pair] == [dense, ssog] and all(r.model_kwargs == kwargs for r in pair)
    # the ODE setting is not the looped trunk again: it is solved on a finer grid
    assert any(kv.startswith('ode_steps=') for kv in SETTINGS['ode'][2])
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


def test_runs_train_log_and_resume(study):
    root, runs, statuses = study
    assert statuses == ['trained', 'trained']
    for run in runs:
        d = run_dir(root, run)
        with open(d / 'summary.csv') as f:
            assert [int(r['epoch']) for r in csv.DictReader(f)] == [0, 1]
        args = vars(torch.load(d / 'last.pth.tar', map_location='cpu', weights_only=False)['args'])
        assert args['model_kwargs'] == ['ode_steps=23'] and args['in_chans'] == 1
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
    dense, ssog, _ = SETTINGS['ode']
    gain = top1[ssog] - top1[dense]
    assert f'{gain:.2f} ± 0.00' in table and '+2.2 to +4.1' in table
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


def test_export_card_carries_measured_top1(study, tmp_path):
    root, runs, _ = study
    best = best_runs(root)
    assert set(best) == {r.arch for r in runs}
    arch = SETTINGS['ode'][1]
    out = export_run(best[arch], 'test', FMNIST_CFG, str(tmp_path), 'a test export', full_test=False)
    repo = tmp_path / f'{arch}.test'
    model = timm.create_model(f'local-dir:{repo}', pretrained=True)
    r = evaluate(model, str(fm.SAMPLE_DIR))
    card = (repo / 'README.md').read_text()
    assert out['Fashion-MNIST sample (1,000 test images, bundled)'] == r['top1']
    assert f'top-1 {r["top1"]:.2f}% ({r["correct"]}/1000)' in card
    assert 'ode_steps=23' in card and '--solver euler:23' in card


def test_committed_recipes_are_current(tmp_path):
    written = write_recipes(tmp_path)
    assert len(written) == 2 * len(FAMILIES) == 12
    for path in written:
        committed = REPO / 'examples' / path.name
        assert committed.is_file(), f'{committed} missing: run python -m timm_odevit.study recipes'
        assert committed.read_text() == path.read_text(), f'{committed} is stale: python -m timm_odevit.study recipes'


@pytest.mark.parametrize('name', sorted(p.name for p in (REPO / 'examples').glob('*.yaml')))
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


def test_recipe_chain_is_recorded_and_carded(idx_folder, tmp_path):
    """A second recipe stage starts from the first one's weights; the card names both stages and their commands."""
    from timm_odevit.hub.export import model_card, model_from_checkpoint
    from timm_odevit.hub.recipe import Recipe, train_to_checkpoint
    arch = 'looped_ssog_tiny_patch4_32'
    first = train_to_checkpoint(arch, Recipe(n_train=32, epochs=1, batch_size=16), str(tmp_path / 'a.pth'),
                                str(idx_folder))
    second = train_to_checkpoint(arch, Recipe(n_train=32, epochs=1, batch_size=16, lr=1e-4,
                                              init_checkpoint=str(first)), str(tmp_path / 'b.pth'), str(idx_folder))
    a = model_from_checkpoint(str(first))
    ckpt = torch.load(second, map_location='cpu', weights_only=True)
    assert [s['lr'] for s in ckpt['recipe']['stages']] == [2e-3, 1e-4]
    card = model_card(arch, 'test', model_from_checkpoint(str(second)), {}, ckpt['recipe'])
    lines = card['details']['Training recipe']
    assert '--init-checkpoint' in lines['stage 2 of 2, command'] and '--lr 0.0001' in lines['stage 2 of 2, command']
    assert '--init-checkpoint' not in lines['stage 1 of 2, command'] and 'stage 1 of 2, data' in lines
    with pytest.raises(ValueError, match='not'):
        train_to_checkpoint('odevit_tiny_patch4_32', Recipe(n_train=32, epochs=1, init_checkpoint=str(first)),
                            str(tmp_path / 'c.pth'), str(idx_folder))
    assert not torch.equal(a.state_dict()['head.weight'], ckpt['state_dict']['head.weight'])


def test_augment_batch_flips_and_shifts_each_image_alone():
    from timm_odevit.hub.recipe import augment_batch
    x = torch.randn(64, 1, 8, 8)
    out = augment_batch(x, torch.Generator().manual_seed(0), shift=1)
    assert out.shape == x.shape
    kinds = set()
    for i in range(len(x)):
        # every output is one of the 2 x 9 flips/shifts of its own input (edge-padded), never another image's
        padded = [torch.nn.functional.pad(v[None], (1,) * 4, mode='replicate')[0] for v in (x[i], x[i].flip(-1))]
        hits = [(f, dy, dx) for f, v in enumerate(padded) for dy in range(3) for dx in range(3)
                if torch.equal(v[:, dy:dy + 8, dx:dx + 8], out[i])]
        assert hits, f'image {i} is not a flip/shift of its input'
        kinds.update(hits)
    assert {k[0] for k in kinds} == {0, 1} and len({k[1:] for k in kinds}) > 4


def test_recipe_command_flags_train_and_card(idx_folder, tmp_path):
    """--augment / --bf16 reach the recipe, train (bf16 autocast, weights stay fp32) and are rendered in the card."""
    from dataclasses import replace

    from timm_odevit.hub.export import model_card, model_from_checkpoint
    from timm_odevit.hub.recipe import compare_precision, parse_command, train_to_checkpoint
    archs, _, _, recipe, _ = parse_command(['ssog_vit_tiny_patch4_32', '--n-train', '32', '--epochs', '1',
                                               '--batch-size', '16', '--augment', '--bf16', '--threads', '2',
                                               '--out-dir', str(tmp_path)])
    assert archs == ['ssog_vit_tiny_patch4_32'] and recipe.augment and recipe.bf16 and recipe.threads == 2
    speeds = compare_precision(archs[0], replace(recipe, batch_size=4), repeats=2)
    assert set(speeds) == {'fp32', 'bf16', 'bf16 / fp32'} and all(v > 0 for v in speeds.values())
    default = parse_command(['ssog_vit_tiny_patch4_32'])[3]
    assert not default.augment and not default.bf16
    path = train_to_checkpoint(archs[0], recipe, str(tmp_path / 'a.pth'), str(idx_folder))
    ckpt = torch.load(path, map_location='cpu', weights_only=True)
    assert all(v.dtype == torch.float32 for v in ckpt['state_dict'].values() if v.is_floating_point())
    lines = model_card(archs[0], 'test', model_from_checkpoint(str(path)), {}, ckpt['recipe'])['details']
    lines = lines['Training recipe']
    assert '--augment --bf16' in lines['command'] and 'OMP_NUM_THREADS=2' in lines['command']
    assert 'bf16 autocast' in lines['schedule'] and 'flip' in lines['data']
    # the card's command reruns the recipe: every non-default option (here batch size 16) survives the round trip
    argv = shlex.split(lines['command'].strip('`'))[3:]
    assert parse_command(argv)[3] == recipe and '--batch-size 16' in lines['command']


def test_training_command_input_stats():
    """Grey Fashion-MNIST uses its own statistics; a 1-channel run on another dataset must say its mean and std."""
    from timm_odevit.distill.__main__ import _input_stats, parse_args
    cfg = {'mean': (0.485, 0.456, 0.406), 'std': (0.229, 0.224, 0.225)}
    assert _input_stats(parse_args(['--in-chans', '1']), cfg) == (fm.FASHION_MNIST_MEAN, fm.FASHION_MNIST_STD)
    assert _input_stats(parse_args([]), cfg) == (cfg['mean'], cfg['std'])
    with pytest.raises(ValueError, match='pass --mean and --std'):
        _input_stats(parse_args(['--in-chans', '1', '--dataset', '']), cfg)
    assert _input_stats(parse_args(['--in-chans', '1', '--dataset', '', '--mean', '0.5', '--std', '0.2']), cfg) == \
        ((0.5,), (0.2,))
