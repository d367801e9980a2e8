"""The training command (python -m timm_odevit_tools.train), its checkpoint loader and the evaluation loop."""
import csv
import hashlib
import json

import pytest
import torch

import timm
import timm_odevit  # noqa: F401
from timm_odevit_tools import data as fm
from timm_odevit_tools.evaluate import evaluate, evaluate_solved, parse_solver, solver_of
from timm_odevit.layers import OdeSolverError
from timm_odevit_tools.train import (format_command, is_training_command, main, model_from_checkpoint, parse_args,
                               read_checkpoint, recorded_args)
from timm_odevit_tools.train.command import RUN_PLACE_OPTIONS, input_stats

ARCH = 'ssog_vit_tiny_patch4_32'


def command(out, *extra: str) -> list:
    # the bundled sample holds the test split only: it serves as both splits here
    return ['--data-dir', str(fm.SAMPLE_DIR), '--train-split', 'test', '--model', ARCH, '--model-kwargs', 'depth=2',
            '--train-samples', '32', '--val-samples', '16', '--batch-size', '8', '--max-steps-per-epoch', '2',
            '--output', str(out), '--experiment', 'run', '--log-interval', '1', '--device', 'cpu', *extra]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))


def test_bf16_augment_ema_resume_and_rerun(tmp_path):
    extra = ('--amp', 'bf16', '--augment', '--model-ema')
    first = main(command(tmp_path, '--epochs', '1', *extra))
    run = tmp_path / 'run'
    ckpt = read_checkpoint(str(run / 'last.pth.tar'))
    assert ckpt['epoch'] == 0 and 'state_dict_ema' in ckpt
    # bf16 autocast leaves the weights in fp32
    assert all(v.dtype == torch.float32 for v in ckpt['state_dict'].values() if v.is_floating_point())
    assert first['history'][0]['nfe'] == 2 and 0 <= first['top1'] <= 100 and 'ema_top1' in first
    assert (run / 'command.txt').read_text().startswith('python -m timm_odevit_tools.train --data-dir')
    assert 'img/s' in (run / 'train.log').read_text()

    second = main(command(tmp_path, '--epochs', '2', '--resume', str(run / 'last.pth.tar'), *extra))
    with open(run / 'summary.csv') as f:
        assert [int(r['epoch']) for r in csv.DictReader(f)] == [0, 1]  # the resumed run trained epoch 1 only
    assert [h['epoch'] for h in second['history']] == [0, 1] and second['history'][0] == first['history'][0]
    steps = {float(s['step']) for s in read_checkpoint(str(run / 'last.pth.tar'))['optimizer']['state'].values()}
    assert steps == {4.}  # Adam continued from the first run's 2 steps

    # a finished run resumed again trains nothing and keeps its record
    third = main(command(tmp_path, '--epochs', '2', '--resume', str(run / 'last.pth.tar'), *extra))
    saved = json.loads((run / 'results.json').read_text())
    assert saved['history'] == second['history'] and saved['top1'] == pytest.approx(second['top1'])
    assert third['loss'] == pytest.approx(second['loss'], rel=1e-3)


def test_run_stopped_before_its_end_keeps_every_epoch_in_its_record(tmp_path):
    """A run killed mid-way never wrote results.json; resumed, it rebuilds the finished epochs' record (validation,
    training seconds) from summary.csv and train.log, so the final record and the card count every epoch."""
    first = main(command(tmp_path, '--epochs', '2'))
    run = tmp_path / 'run'
    (run / 'results.json').unlink()  # what a run stopped during its third epoch leaves
    resumed = main(command(tmp_path, '--epochs', '3', '--resume', str(run / 'last.pth.tar')))
    history = json.loads((run / 'results.json').read_text())['history']
    assert [h['epoch'] for h in history] == [0, 1, 2]
    for was, kept in zip(first['history'], history[:2]):
        assert kept['top1'] == pytest.approx(was['top1']) and kept['loss'] == pytest.approx(was['loss'])
        assert kept['train_loss'] == pytest.approx(was['train_loss'])
        assert kept['train_seconds'] == round(was['train_seconds'])  # train.log keeps whole seconds
    assert resumed['history'] == history

    from timm_odevit_tools.hub.card import training_lines
    from timm_odevit.models.pretrained import FMNIST_CFG
    args = vars(parse_args(command(tmp_path, '--epochs', '3')))
    minutes = sum(h['train_seconds'] for h in history) / 60
    assert f'{minutes:.1f} min of training steps' in training_lines(args, FMNIST_CFG, history=history)['budget']
    # a record that misses an epoch gives no minutes rather than too few
    assert 'min of training steps' not in training_lines(args, FMNIST_CFG, history=history[1:])['budget']


def test_resume_refuses_another_architecture(tmp_path):
    main(command(tmp_path, '--epochs', '1'))
    last = str(tmp_path / 'run' / 'last.pth.tar')
    with pytest.raises(ValueError, match='depth'):
        main(command(tmp_path, '--epochs', '2', '--resume', last, '--model-kwargs', 'depth=3'))
    with pytest.raises(ValueError, match='looped_ssog'):
        main(command(tmp_path, '--epochs', '2', '--resume', last, '--model', 'looped_ssog_tiny_patch4_32'))


def test_a_new_run_refuses_a_named_folder_holding_another_run(tmp_path):
    main(command(tmp_path, '--epochs', '1'))
    run = tmp_path / 'run'
    before = {name: (run / name).read_bytes() for name in ('summary.csv', 'command.txt', 'last.pth.tar')}
    with pytest.raises(FileExistsError, match=f'--experiment run: .* --resume {run / "last.pth.tar"}'):
        main(command(tmp_path, '--epochs', '1', '--lr', '1e-4'))
    assert {name: (run / name).read_bytes() for name in before} == before  # nothing of the first run is touched


def test_torchcompile_checkpoint_has_plain_keys_and_starts_a_next_stage(tmp_path):
    result = main(command(tmp_path, '--epochs', '1', '--torchcompile', 'eager'))
    last = str(tmp_path / 'run' / 'last.pth.tar')
    sd = read_checkpoint(last)['state_dict']
    assert not any(k.startswith(('_orig_mod.', 'module.')) for k in sd)
    model = model_from_checkpoint(last, depth=2)
    assert result['history'][0]['nfe'] == 2 and model.nfe == 0
    # a next stage starts from these weights with a fresh optimizer and schedule (epoch 0 again)
    stage2 = main(command(tmp_path / 'stage2', '--epochs', '1', '--initial-checkpoint', last, '--lr', '0',
                       '--min-lr', '0'))
    ckpt = read_checkpoint(str(tmp_path / 'stage2' / 'run' / 'last.pth.tar'))
    assert ckpt['epoch'] == 0 and stage2['history'][0]['epoch'] == 0
    # the record names the weights it started from by hash (an export checks them); a first stage names none
    with open(last, 'rb') as f:
        assert stage2['initial_checkpoint_sha256'] == hashlib.sha256(f.read()).hexdigest()
    assert 'initial_checkpoint_sha256' not in result
    assert all(torch.equal(ckpt['state_dict'][k], v) for k, v in sd.items())  # lr 0: the weights are the first's


@pytest.mark.parametrize('argv, message', [
    (['--train-samples', '-5'], '--train-samples must be at least 1'),
    (['--val-samples', '0'], '--val-samples must be at least 1'),
    (['--epochs', '0'], '--epochs must be at least 1'),
    (['--data-dir', '/nonexistent/fmnist'], '/nonexistent/fmnist does not exist'),
    (['--resume', '/nonexistent/last.pth.tar'], 'no such checkpoint'),
    (['--smoothing', '1.0'], '--smoothing must be in [0, 1)'),
])
def test_bad_options_fail_early_and_say_why(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_label_smoothing_reaches_the_task_loss():
    """--smoothing is timm's LabelSmoothingCrossEntropy in the task, alone and as a student's label loss."""
    from timm.loss import LabelSmoothingCrossEntropy
    from timm_odevit_tools.train.command import build_task
    x, y = torch.randn(4, 1, 32, 32), torch.tensor([0, 1, 2, 3])
    plain = build_task(parse_args(['--model', ARCH]), torch.device('cpu'))
    smooth = build_task(parse_args(['--model', ARCH, '--smoothing', '0.3']), torch.device('cpu'))
    smooth.get_trainable_module().load_state_dict(plain.get_trainable_module().state_dict())
    assert isinstance(smooth.criterion, LabelSmoothingCrossEntropy) and smooth.criterion.smoothing == 0.3
    assert not torch.allclose(smooth(x, y)['loss'], plain(x, y)['loss'])
    student = build_task(parse_args(['--model', 'odevit_tiny_patch4_32', '--model-kwargs', 'depth=2', '--teacher',
                                     'dense_vit_tiny_patch4_32', '--teacher-kwargs', 'depth=2', 'in_chans=1',
                                     '--smoothing', '0.3']), torch.device('cpu'))
    assert isinstance(student.criterion, LabelSmoothingCrossEntropy)


def test_data_dir_without_a_train_split_says_so(tmp_path):
    with pytest.raises(ValueError, match='no train images'):
        main(['--data-dir', str(fm.SAMPLE_DIR), '--output', str(tmp_path), '--epochs', '1'])


def test_card_command_reparses_to_the_same_options():
    args = parse_args(['--model', ARCH, '--model-kwargs', 'depth=2', 'ode_method=rk4', '--augment', '--amp', 'bf16',
                       '--lr', '2e-3', '--mean', '0.5', '--std', '0.2', '--output', 'somewhere'])
    line = format_command(vars(args), threads=2)
    assert line.startswith('OMP_NUM_THREADS=2 python -m timm_odevit_tools.train --model ') and 'somewhere' not in line
    again = vars(recorded_args(line))
    assert {k: v for k, v in again.items() if k not in {*RUN_PLACE_OPTIONS, 'trainer', 'threads'}} == \
        {k: v for k, v in vars(args).items() if k not in {*RUN_PLACE_OPTIONS, 'trainer', 'threads'}}
    assert is_training_command(line) and not is_training_command('python train.py --model ' + ARCH)
    assert not is_training_command('python -m timm_odevit.training --model ' + ARCH)  # whole words only
    with pytest.raises(ValueError, match='not a command of python -m timm_odevit_tools.train'):
        recorded_args('python train.py --model ' + ARCH)


def test_input_stats():
    """Grey Fashion-MNIST uses its own statistics; a 1-channel run on another dataset must say its mean and std."""
    cfg = {'mean': (0.485, 0.456, 0.406), 'std': (0.229, 0.224, 0.225)}
    assert input_stats(parse_args([]), cfg) == (fm.FASHION_MNIST_MEAN, fm.FASHION_MNIST_STD)
    assert input_stats(parse_args(['--in-chans', '3']), cfg) == (cfg['mean'], cfg['std'])
    with pytest.raises(ValueError, match='pass --mean and --std'):
        input_stats(parse_args(['--dataset', '']), cfg)
    assert input_stats(parse_args(['--dataset', '', '--mean', '0.5', '--std', '0.2']), cfg) == ((0.5,), (0.2,))


# ------------------------------------------------------------------------------------------------ checkpoint loader
def test_model_from_checkpoint_strips_wrapper_prefixes(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model(ARCH, num_classes=10, in_chans=1, depth=2)
    sd = model.state_dict()
    for i, prefix in enumerate(('module.', '_orig_mod.', '_orig_mod.module.')):
        path = tmp_path / f'{i}.pth'
        torch.save({'arch': ARCH, 'state_dict': {prefix + k: v for k, v in sd.items()}}, path)
        loaded = model_from_checkpoint(str(path), depth=2)
        assert not loaded.training and loaded.pretrained_cfg['architecture'] == ARCH
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items())
    with pytest.raises(ValueError, match='architecture'):
        torch.save({'state_dict': sd}, tmp_path / 'anon.pth')
        model_from_checkpoint(str(tmp_path / 'anon.pth'))


# ------------------------------------------------------------------------------------------------ evaluation
def test_evaluate_top1_and_nfe_on_tensors_and_loaders():
    torch.manual_seed(0)
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10, in_chans=1, ode_steps=5)
    x, y = torch.randn(10, 1, 32, 32), torch.randint(0, 10, (10,))
    with torch.no_grad():
        expected = 100. * (model.eval()(x).argmax(-1) == y).sum().item() / 10
    r = evaluate(model, (x, y), batch_size=4)
    assert r['top1'] == pytest.approx(expected) and r['n'] == 10 and r['nfe'] == 5
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)
    assert evaluate(model, loader)['correct'] == r['correct']
    assert evaluate(model, (x, y), amp_dtype=torch.bfloat16)['nfe'] == 5
    model.set_solver(method='rk4', steps=2)
    assert evaluate(model, (x, y))['nfe'] == 8  # four field evaluations per rk4 step
    vit = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=1, num_classes=10, in_chans=1)
    assert evaluate(vit, (x, y))['nfe'] is None
    with pytest.raises(ValueError, match='no images'):
        evaluate(model, [])
    assert parse_solver('rk4:6') == ('rk4', 6)
    with pytest.raises(ValueError, match='method:steps'):
        parse_solver('euler')


def test_evaluate_solved_measures_registered_and_other_solver_and_restores_the_model():
    torch.manual_seed(0)
    model = timm.create_model('odevit_tiny_patch4_32', num_classes=10, in_chans=1, ode_steps=3, ode_max_nfe=50)
    x, y = torch.randn(6, 1, 32, 32), torch.randint(0, 10, (6,))
    r = evaluate_solved(model, (x, y), {'method': 'rk4', 'steps': 2}, batch_size=4)
    assert r['registered']['solver'] == 'euler:3' and r['registered']['nfe'] == 3
    assert r['solver']['solver'] == 'rk4:2' and r['solver']['nfe'] == 8
    model.set_solver(method='rk4', steps=2)
    assert r['solver']['top1'] == evaluate(model, (x, y))['top1']
    model.set_solver(method='euler', steps=3)
    # a solver the model already has is not measured twice; a failing one leaves the model as it came
    assert set(evaluate_solved(model, (x, y), {'steps': 3})) == {'registered'}
    with pytest.raises(OdeSolverError, match='max_nfe=5 '):
        evaluate_solved(model, (x, y), {'method': 'dopri5', 'rtol': 1e-9, 'atol': 1e-9, 'max_nfe': 5})
    assert solver_of(model) == 'euler:3' and model.trunk.max_nfe == 50 and model.trunk.rtol != 1e-9
    vit = timm.create_model('dense_vit_tiny_patch4_32', num_classes=10, in_chans=1)
    assert evaluate_solved(vit, (x, y))['registered']['solver'] == 'discrete'


def test_augment_batch_flips_and_shifts_each_image_alone():
    x = torch.randn(64, 1, 8, 8)
    out = fm.augment_batch(x, shift=1, generator=torch.Generator().manual_seed(0))
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


def test_resumed_run_ends_bit_identical_to_uninterrupted(tmp_path):
    """Data order, augmentation, optimizer, schedule and EMA continue exactly: resuming after epoch 0 ends with
    the weights of the uninterrupted run (same seed, CPU)."""
    extra = ('--augment', '--model-ema', '--warmup-epochs', '1')
    whole = main(command(tmp_path / 'whole', '--epochs', '2', *extra))
    # an interruption after epoch 0: resume the checkpoint of epoch 0 in a fresh folder
    resumed = main(command(tmp_path / 'whole_again', '--epochs', '2', '--resume',
                           str(tmp_path / 'whole' / 'run' / 'checkpoint-0.pth.tar'), *extra))
    assert resumed['rank_state_sha256'] == whole['rank_state_sha256']
    ema = [read_checkpoint(str(p / 'run' / 'last.pth.tar'))['state_dict_ema'] for p in (tmp_path / 'whole',
                                                                                           tmp_path / 'whole_again')]
    assert all(torch.equal(ema[0][k], ema[1][k]) for k in ema[0])


def test_device_batches_hold_every_image_and_shard_each_epoch_alike_on_every_rank():
    images = torch.arange(20.).reshape(20, 1, 1, 1)
    loader = [(images[i:i + 6], torch.arange(20)[i:i + 6]) for i in range(0, 20, 6)]  # an uneven last batch
    ranks = [fm.DeviceBatches(loader, 'cpu', batch_size=3, shuffle=True, seed=5, rank=r, world=2) for r in range(2)]
    assert [len(b) for b in ranks] == [3, 3]  # 10 images a rank, whole batches only
    seen = []
    for epoch in (0, 1):
        for b in ranks:
            b.set_epoch(epoch)
        batches = [list(b) for b in ranks]
        for x, y in (pair for rank in batches for pair in rank):
            assert torch.equal(x.flatten().long(), y) and x.shape == (3, 1, 1, 1)  # images keep their labels
        labels = [torch.cat([y for _, y in rank]) for rank in batches]
        assert not set(labels[0].tolist()) & set(labels[1].tolist())  # the ranks share no image within an epoch
        seen.append(torch.cat(labels))
        # the same seed and epoch draw the same order again
        assert torch.equal(torch.cat([y for _, y in ranks[0]]), labels[0])
    assert not torch.equal(seen[0], seen[1])  # each epoch its own permutation
    ordered = fm.DeviceBatches(loader, 'cpu', batch_size=8, shuffle=False)
    assert len(ordered) == 3 and torch.equal(torch.cat([y for _, y in ordered]), torch.arange(20))


def test_data_on_device_trains_on_the_loaders_images(tmp_path):
    """--data-on-device decodes each split once through the transform the loader path uses: validation on the held
    images measures what validation through the loader measures, and training runs from them."""
    on_device = main(command(tmp_path, '--epochs', '1', '--data-on-device', '--augment'))
    args = ['--epochs', '1', '--resume', str(tmp_path / 'run' / 'last.pth.tar'), '--experiment', 'measured']
    through_loader = main(command(tmp_path, *args))
    assert through_loader['loss'] == pytest.approx(on_device['loss'], rel=1e-5)
    assert through_loader['top1'] == on_device['top1'] and on_device['history'][0]['train_loss'] > 0


def test_img_size_sets_a_cnns_input_and_refuses_a_vits_other_size(tmp_path, monkeypatch):
    """--img-size: a timm CNN trains at the size given (its cfg says 224, timm's train.py default); a ViT built for
    32 px refuses another size and names the option that builds it for that size."""
    import timm_odevit_tools.train.command as cmd
    argv = command(tmp_path, '--epochs', '1', '--max-steps-per-epoch', '1', '--img-size', '16')
    argv[argv.index(ARCH) + 1:argv.index(ARCH) + 3] = []  # resnet10t takes no depth=2
    argv[argv.index(ARCH)] = 'resnet10t'
    task = cmd.build_task(parse_args(argv), torch.device('cpu'))
    seen = []
    task.get_eval_model().register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape[1:])))
    monkeypatch.setattr(cmd, 'build_task', lambda args, device: task)  # the task whose inputs are watched
    main(argv)
    assert seen and set(seen) == {(1, 16, 16)}
    monkeypatch.undo()
    with pytest.raises(ValueError, match='--model-kwargs img_size=64'):
        main(command(tmp_path / 'vit', '--epochs', '1', '--img-size', '64'))
