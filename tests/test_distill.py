"""Trajectory distillation: the task, its losses and time rules, plug-and-play init, and the training command with
--teacher."""
import csv
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.layers import resample_abs_pos_embed
from torch import nn

import timm_odevit  # noqa: F401
from timm_odevit.distill import (
    LOSS_KEYS, TrajectoryDistillationTask, cls_distances, copy_from_teacher, indices_to_times, jasmin_loss,
    paper_times, solver_grid, uniform_times,
)
from timm_odevit_tools.train import main as train_main
from timm_odevit_tools.train.command import guidance_summary
from tiers import slow_except

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_TEACHER = dict(img_size=32, patch_size=4, depth=3, num_classes=10)


def make_teacher(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model('vit_tiny_patch16_224', **dict(SMALL_TEACHER, **kwargs))


def make_student(name: str = 'odevit_tiny_patch4_32', **kwargs) -> nn.Module:
    torch.manual_seed(1)
    return timm.create_model(name, **dict(dict(depth=3, num_classes=10), **kwargs))


@pytest.fixture(scope='module')
def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def train_steps(task: TrajectoryDistillationTask, x, y, steps: int = 3, lr: float = 1e-3):
    params = [p for p in task.get_trainable_module().parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    history = []
    task.train()
    for _ in range(steps):
        out = task(x, y)
        opt.zero_grad()
        out['loss'].backward()
        opt.step()
        history.append({k: float(out[k].detach()) for k in ('loss',) + LOSS_KEYS})
    return history


# ------------------------------------------------------------------------------------------------ teacher isolation
def test_teacher_bit_identical_after_training(batch):
    teacher = make_teacher()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    task = TrajectoryDistillationTask(make_student(), teacher, times='paper', kd_loss_weight=1., state_tokens='all',
                                      verbose=False)
    train_steps(task, *batch, steps=3, lr=1e-2)
    after = teacher.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())
    # the student's copied stem really trained away from the teacher: the copies are not shared storage
    student = task.trainable_module_student()
    assert not torch.equal(student.pos_embed, teacher.pos_embed)


def test_gradients_reach_only_student_and_projection(batch):
    teacher = make_teacher(embed_dim=96, num_heads=3)  # narrower teacher: needs the learned projection
    task = TrajectoryDistillationTask(make_student(), teacher, init_from_teacher=False, kd_loss_weight=1.,
                                      verbose=False)
    trainable = task.get_trainable_module()
    assert isinstance(trainable.projection, nn.Linear)
    assert trainable.projection.in_features == 192 and trainable.projection.out_features == 96
    out = task(*batch)
    out['loss'].backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in trainable.projection.parameters())
    student_grads = {n: p.grad for n, p in trainable.student.named_parameters() if p.requires_grad}
    assert all(g is not None for g in student_grads.values()), [n for n, g in student_grads.items() if g is None]
    assert student_grads['trunk.block.mixer.qkv.weight'].abs().sum() > 0
    # task-owned trainable state is exactly student + projection
    owned = {id(p) for p in trainable.parameters()}
    assert owned.isdisjoint(id(p) for p in teacher.parameters())


# JaSMin takes each map's worst row (a max): Adam's first steps at 3e-3 jump between rows, so it gets a small rate
@pytest.mark.parametrize('term,lr', slow_except([('state_loss', 3e-3), ('attn_loss', 3e-3), ('kd_loss', 3e-3),
                                                 ('task_loss', 3e-3), ('jasmin_loss', 1e-4)],
                                                fast=lambda c: c[0] == 'task_loss'))
def test_each_loss_term_falls(batch, term, lr):
    weights = dict(state_loss_weight=0., attn_loss_weight=0., kd_loss_weight=0., task_loss_weight=0.,
                   jasmin_weight=0.)
    weights[{'state_loss': 'state_loss_weight', 'attn_loss': 'attn_loss_weight', 'kd_loss': 'kd_loss_weight',
             'task_loss': 'task_loss_weight', 'jasmin_loss': 'jasmin_weight'}[term]] = 1.
    # no copied head: with it, student and teacher logits start nearly equal and KD has nothing to learn
    task = TrajectoryDistillationTask(make_student(), make_teacher(), init_from_teacher=('patch_embed',),
                                      verbose=False, **weights)
    history = train_steps(task, *batch, steps=6, lr=lr)
    values = [h[term] for h in history]
    assert values[-1] < values[0], values
    assert history[0][term] != 0


def test_label_loss_starts_at_its_epoch(batch):
    task = TrajectoryDistillationTask(make_student(), make_teacher(), task_loss_start_epoch=2, verbose=False)
    out = {k: v.detach() for k, v in task(*batch).items()}
    no_label = out['loss'] - 0.5 * out['state_loss'] - 0.25 * out['attn_loss'] - out['jasmin_loss']
    assert abs(float(no_label)) < 1e-5 and float(out['task_loss']) > 0
    task.set_epoch(2)
    out = {k: v.detach() for k, v in task(*batch).items()}
    with_label = out['loss'] - 0.5 * out['state_loss'] - 0.25 * out['attn_loss'] - out['jasmin_loss']
    assert float(with_label) == pytest.approx(float(out['task_loss']), rel=1e-5)


@pytest.mark.parametrize('norm', ['none', 'layernorm'])
def test_state_gaps_are_the_state_loss_per_target(batch, norm):
    """state_gaps(x) gives one distance per target time, and their sum is the step's state loss; several distances
    give a row each."""
    task = TrajectoryDistillationTask(make_student(), make_teacher(), state_norm=norm, kd_loss_weight=1.,
                                      verbose=False).eval()
    gaps = task.state_gaps(batch[0])
    assert gaps.shape == (3,) and (gaps > 0).all()
    with torch.no_grad():
        assert float(gaps.sum()) == pytest.approx(float(task(*batch)['state_loss']), rel=1e-5)
    cosine = task.state_gaps(batch[0], 'cosine')
    assert ((cosine > 0) & (cosine <= 2)).all() and not torch.allclose(cosine, gaps)
    both = task.state_gaps(batch[0], (norm, 'cosine'))  # several distances: a row each, from one solve
    assert both.shape == (2, 3)
    torch.testing.assert_close(both, torch.stack([gaps, cosine]))


# ------------------------------------------------------------------------------------------------ time mapping
def test_uniform_times_on_grid():
    grid = torch.linspace(0, 12, 13, dtype=torch.float64)[1:]
    assert uniform_times(12, 12., grid).tolist() == list(range(1, 13))
    assert uniform_times(4, 12., grid).tolist() == [3., 6., 9., 12.]
    # 5 targets on 12 unit steps: nearest points to 2.4, 4.8, 7.2, 9.6, 12
    assert uniform_times(5, 12., grid).tolist() == [2., 5., 7., 10., 12.]
    # a 24-step grid over [0, 12]: half steps
    fine = torch.linspace(0, 12, 25, dtype=torch.float64)[1:]
    assert uniform_times(3, 12., fine).tolist() == [4., 8., 12.]
    # adaptive solvers have no grid: exact times
    assert uniform_times(3, 1.5, None).tolist() == pytest.approx([0.5, 1., 1.5])


def test_paper_rule_reproduces_the_papers_indices():
    # distances proportional to the paper's index gaps give back its 36-point mapping [3, 6, 8, ..., 24, 35]
    indices = [3, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 35]
    gaps = torch.tensor(np.diff([0] + indices), dtype=torch.float64) * 0.37
    grid = torch.linspace(0, 12, 36, dtype=torch.float64)[1:]  # 35 Euler steps over [0, 12]
    times = paper_times(gaps, 12., grid)
    assert torch.allclose(times, grid[[i - 1 for i in indices]])
    student = make_student(depth=35, ode_steps=35, ode_t_end=12.)
    assert torch.allclose(indices_to_times(indices, student), times)


def test_paper_rule_snaps_and_stays_increasing():
    grid = torch.arange(1, 5, dtype=torch.float64)
    # the first two blocks barely move CLS: snapping would put three targets on point 0 without the spreading
    assert paper_times(torch.tensor([1e-3, 1e-3, 1e-3, 1.]), 4., grid).tolist() == [1., 2., 3., 4.]
    # a late jump: most of the depth goes to the last block
    assert paper_times(torch.tensor([1., 1., 8.]), 4., grid).tolist() == [1., 2., 4.]
    states = torch.zeros(3, 2, 4)
    states[1, :, 0], states[2, :, 0] = 3., 7.
    assert cls_distances(states).tolist() == pytest.approx([3., 4.])


def test_paper_rule_in_task_uses_teacher_cls_distances(batch):
    teacher = make_teacher()
    student = make_student(depth=6)
    task = TrajectoryDistillationTask(student, teacher, times='paper', calibration_input=batch[0], verbose=False)
    # independent recomputation: the state before block 0 from a hook, block outputs from forward_intermediates
    seen = {}
    h = teacher.blocks[0].register_forward_pre_hook(lambda m, a: seen.setdefault('x', a[0]))
    x_t = task.teacher.normalize_input(batch[0], task.student_mean, task.student_std)
    with torch.no_grad():
        _, inter = teacher.forward_intermediates(x_t, return_prefix_tokens=True, output_fmt='NLC')
    h.remove()
    cls = torch.stack([seen['x'][:, 0]] + [prefix[:, 0] for _, prefix in inter])
    d = (cls[1:] - cls[:-1]).norm(dim=-1).mean(1).double()
    expected = paper_times(d, 6., solver_grid(student))
    assert torch.equal(task.target_times, expected)
    assert task.target_times[-1] == 6. and bool((task.target_times.diff() > 0).all())


def test_solver_grid_is_the_trunks_own_also_after_pruning():
    student = make_student('odevit_tiny_patch4_32', depth=12)
    assert torch.allclose(solver_grid(student), torch.arange(1, 13, dtype=torch.float64))
    student.trunk.prune(6)  # the interval ends at layer 6's time; the solver keeps its points (unit steps)
    assert torch.allclose(solver_grid(student), torch.arange(1, 7, dtype=torch.float64))
    assert solver_grid(student).tolist() == student.trunk.solver_grid(student.trunk.t_end)[1:]


def test_looped_student_and_explicit_times(batch):
    task = TrajectoryDistillationTask(make_student('looped_vit_tiny_patch4_32', depth=6), make_teacher(),
                                      times=[2., 4., 6.], verbose=False)
    history = train_steps(task, *batch, steps=2)
    assert all(np.isfinite(h['loss']) for h in history)
    # an SSoG student has no attention maps: only those terms must be switched off
    task = TrajectoryDistillationTask(make_student('ssog_ode_tiny_patch4_32'), make_teacher(), attn_loss_weight=0.,
                                      jasmin_weight=0., verbose=False)
    assert np.isfinite(train_steps(task, *batch, steps=1)[0]['state_loss'])


# ------------------------------------------------------------------------------------------------ JaSMin
def test_jasmin_has_gradient_unless_detached(batch):
    def qkv_grad(detach: bool) -> torch.Tensor:
        task = TrajectoryDistillationTask(make_student(), make_teacher(), state_loss_weight=0., attn_loss_weight=0.,
                                          task_loss_weight=0., jasmin_weight=1., jasmin_detach=detach, verbose=False)
        out = task(*batch)
        out['loss'].backward()
        return task.trainable_module_student().trunk.block.mixer.qkv.weight.grad

    assert qkv_grad(False).abs().sum() > 0
    assert qkv_grad(True).abs().sum() == 0

    p = torch.softmax(torch.randn(2, 3, 5, 7), dim=-1).requires_grad_()
    jasmin_loss(p, k=2).backward()
    assert p.grad.abs().sum() > 0
    # the definition: log(g_1 / g_k), g_k = p_(k) (1 - p_(k) + p_(k+1)); worst row, mean over the rest
    row = torch.tensor([[[0.5, 0.3, 0.2]]])
    g1, g2 = 0.5 * (1 - 0.5 + 0.3), 0.3 * (1 - 0.3 + 0.2)
    assert float(jasmin_loss(row, k=2)) == pytest.approx(np.log(g1 / g2), rel=1e-5)
    assert float(jasmin_loss(row, k=0)) == pytest.approx(np.log(g1), rel=1e-5)
    with pytest.raises(ValueError):
        jasmin_loss(row, k=1)


# ------------------------------------------------------------------------------------------------ plug-and-play
def test_plug_and_play_copies_new_tensors_and_resamples():
    teacher = make_teacher(img_size=64)  # 16x16 patch grid; the student's is 8x8
    nn.init.normal_(teacher.patch_embed.proj.bias)
    student = make_student()
    names = copy_from_teacher(student, teacher, freeze=True)
    assert set(names) == {'patch_embed.proj.weight', 'patch_embed.proj.bias', 'cls_token', 'pos_embed',
                          'head.weight', 'head.bias'}
    assert torch.equal(student.patch_embed.proj.weight, teacher.patch_embed.proj.weight)
    assert torch.equal(student.patch_embed.proj.bias, teacher.patch_embed.proj.bias)
    assert torch.equal(student.cls_token, teacher.cls_token)
    assert torch.equal(student.head.weight, teacher.head.weight)
    expected = resample_abs_pos_embed(teacher.pos_embed[:, 1:], new_size=(8, 8), old_size=(16, 16),
                                      num_prefix_tokens=0)
    assert torch.equal(student.pos_embed[:, 1:], expected)
    assert torch.equal(student.pos_embed[:, :1], teacher.pos_embed[:, :1])
    for n, p in student.named_parameters():
        assert p.requires_grad == (n not in names)
    teacher_storage = {p.data_ptr() for p in teacher.parameters()}
    assert all(p.data_ptr() not in teacher_storage for p in student.parameters())


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_raise_clear_errors(batch):
    with pytest.raises(TypeError, match='forward_intermediates'):
        TrajectoryDistillationTask(make_student(), nn.Sequential(nn.Flatten(), nn.Linear(3072, 10)), verbose=False)
    with pytest.raises(ValueError, match='strictly increasing'):
        TrajectoryDistillationTask(make_student(), make_teacher(), times=[1., 3., 2.], verbose=False)
    with pytest.raises(ValueError, match=r'\(0, 3.0\]'):
        TrajectoryDistillationTask(make_student(), make_teacher(), times=[1., 2., 3.5], verbose=False)
    with pytest.raises(ValueError, match=r'\(0, 3.0\]'):
        TrajectoryDistillationTask(make_student(), make_teacher(), times=[0., 2., 3.], verbose=False)
    with pytest.raises(ValueError, match='one time per target'):
        TrajectoryDistillationTask(make_student(), make_teacher(), times=[1., 2.], verbose=False)
    for rule in ('uniform', 'paper'):
        with pytest.raises(ValueError, match='only 3 points'):
            TrajectoryDistillationTask(make_student(), make_teacher(depth=4), times=rule, verbose=False)
    with pytest.raises(ValueError, match='same classes'):
        TrajectoryDistillationTask(make_student(), make_teacher(num_classes=5), kd_loss_weight=1.,
                                   init_from_teacher=('patch_embed',), verbose=False)
    with pytest.raises(TypeError, match='DepthVisionTransformer'):
        TrajectoryDistillationTask(make_teacher(), make_teacher(), verbose=False)
    with pytest.raises(ValueError, match='attention maps'):
        TrajectoryDistillationTask(make_student('ssog_ode_tiny_patch4_32'), make_teacher(), verbose=False)


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope='module')
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp('images')
    rng = np.random.default_rng(0)
    for split, n in (('train', 8), ('validation', 4)):
        for c in range(3):
            d = root / split / f'class{c}'
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray((rng.random((32, 32, 3)) * 80 + 80 * c).astype(np.uint8)).save(d / f'{i}.png')
    return str(root)


def command(image_folder: str, out: str, *extra: str) -> list:
    return ['--dataset', '', '--data-dir', image_folder, '--val-split', 'validation', '--num-classes', '3',
            '--in-chans', '3', '--model', 'odevit_tiny_patch4_32', '--model-kwargs', 'depth=3',
            '--teacher', 'vit_tiny_patch16_224', '--teacher-kwargs', 'img_size=32', 'patch_size=4', 'depth=3',
            '--batch-size', '4', '--output', out, '--experiment', 'run', '--log-interval', '1', '--device', 'cpu',
            *extra]


@pytest.mark.slow
def test_torchrun_two_ranks_end_identical(image_folder, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=REPO)
    with socket.socket() as s:  # a free port: a fixed one collides with another test run on the machine
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(port),
           '-m', 'timm_odevit_tools.train', *command(image_folder, str(tmp_path), '--epochs', '1',
                                                '--max-steps-per-epoch', '2', '--times', 'paper', '--model-ema')]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.load(open(tmp_path / 'run' / 'results.json'))
    assert results['world_size'] == 2
    digests = results['rank_state_sha256']
    assert len(digests) == 2 and digests[0] == digests[1]
    ckpt = torch.load(tmp_path / 'run' / 'last.pth.tar', map_location='cpu', weights_only=False)
    assert 'state_dict_ema' in ckpt and ckpt['task_state']['target_times'][-1] == 3.


def test_resume_continues_from_saved_epoch(image_folder, tmp_path):
    first = train_main(command(image_folder, str(tmp_path), '--epochs', '1', '--max-steps-per-epoch', '2'))
    run = tmp_path / 'run'
    assert torch.load(run / 'last.pth.tar', map_location='cpu', weights_only=False)['epoch'] == 0
    saved = torch.load(run / 'last.pth.tar', map_location='cpu', weights_only=False)['state_dict']
    second = train_main(command(image_folder, str(tmp_path), '--epochs', '2', '--max-steps-per-epoch', '2',
                                  '--resume', str(run / 'last.pth.tar')))
    with open(run / 'summary.csv') as f:
        epochs = [int(r['epoch']) for r in csv.DictReader(f)]
    assert epochs == [0, 1]  # the resumed run trained epoch 1 only
    ckpt = torch.load(run / 'last.pth.tar', map_location='cpu', weights_only=False)
    assert ckpt['epoch'] == 1
    # model and optimizer continued: Adam has taken the first run's 2 steps plus 2 more, and the weights moved on
    steps = {float(s['step']) for s in ckpt['optimizer']['state'].values()}
    assert steps == {4.}
    assert any(not torch.equal(saved[k], ckpt['state_dict'][k]) for k in saved)
    assert first['epochs'] == 1 and second['epochs'] == 2


def test_run_records_its_teachers_weights_by_hash_and_the_card_names_it(image_folder, tmp_path):
    """A guided run's record keeps the sha256 of its --teacher-checkpoint; the export names a teacher that is no
    published revision by that hash on the card's teacher line, and refuses a teacher file changed since the run."""
    import hashlib
    from timm_odevit_tools.hub.card import guidance_line
    from timm_odevit_tools.hub.revisions import weights_source
    teacher = tmp_path / 'teacher.pth'
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=4, depth=3, num_classes=3)
    torch.save(model.state_dict(), teacher)
    results = train_main(command(image_folder, str(tmp_path), '--epochs', '1', '--max-steps-per-epoch', '1',
                                 '--teacher-checkpoint', str(teacher)))
    sha = hashlib.sha256(teacher.read_bytes()).hexdigest()
    assert results['teacher_checkpoint_sha256'] == sha == results['guidance']['teacher_checkpoint_sha256']
    source = weights_source(str(teacher), results['teacher_checkpoint_sha256'])
    assert source == {'weights': str(teacher), 'sha256': sha}
    line = guidance_line({'teacher': 'vit_tiny_patch16_224', 'teacher_checkpoint': str(teacher)}, results['guidance'],
                         source)
    assert line.startswith(f'teacher `vit_tiny_patch16_224` (weights `{teacher}`, sha256 {sha}); ')
    torch.save({k: v + 1 for k, v in model.state_dict().items()}, teacher)
    with pytest.raises(ValueError, match='changed after the run loaded it'):
        weights_source(str(teacher), results['teacher_checkpoint_sha256'])


def test_compile_wraps_the_student_and_keeps_eval_and_checkpoint_plain(batch):
    """--torchcompile with a teacher: the trainable student is compiled, validation and checkpoints see the plain
    student (no '_orig_mod.' keys)."""
    task = TrajectoryDistillationTask(make_student(), make_teacher(), verbose=False)
    student = task.get_eval_model()
    assert task.compile(backend='eager') is student
    assert task.trainable_module is not None and hasattr(task.trainable_module, '_orig_mod')
    assert task.get_eval_model() is student
    assert not any(k.startswith('_orig_mod.') for k in task.get_checkpoint_state()['state_dict'])
    x, y = batch
    out = task(x, y)
    assert torch.isfinite(out['loss'])


@pytest.mark.parametrize('name,times', slow_except([
    ('odevit_tiny_patch4_32', [0.75, 1.5, 3.]), ('looped_vit_tiny_patch4_32', [1., 3.]),
    ('dense_vit_tiny_patch4_32', [2., 3.]), ('looped_vit_tiny_patch4_32', [1.])],
    fast=lambda c: c[0].startswith('odevit')))
def test_trajectory_forward_is_one_graph_with_the_last_evaluations_map(name, times, batch):
    """The guided training forward (states at the targets and the last field evaluation's attention) traces as one
    graph, and its map is the one the mixer computes at its last call (seen here by a hook, in eager)."""
    from timm_odevit.distill.task import TrajectoryTrainableModule
    kwargs = dict(ode_steps=4, depth=3) if name.startswith('odevit') else {}
    student = make_student(name, **kwargs).eval()
    block = student.trunk.field_blocks()[-1]
    seen = []
    handle = block.mixer.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        student(batch[0])
    handle.remove()
    expected = block.mixer(seen[-1], (8, 8), return_attn=True)[1]
    module = TrajectoryTrainableModule(student)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(module)(batch[0], times, return_attn=True)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    with torch.no_grad():
        logits, states, attn = torch.compile(module, fullgraph=True, backend='eager')(batch[0], times, return_attn=True)
    torch.testing.assert_close(attn, expected)
    torch.testing.assert_close(logits, student(batch[0]))
    assert states.shape[0] == len(times)
    torch._dynamo.reset()


def test_clip_parameters_exclude_the_head_by_name():
    """Gradient clipping without the head leaves out exactly the classifier's parameters, wherever it is registered."""
    student = make_student()
    task = TrajectoryDistillationTask(student, make_teacher(), verbose=False)
    head = {id(p) for p in student.get_classifier().parameters()}
    every = task.get_clip_parameters()
    kept = task.get_clip_parameters(exclude_head=True)
    assert {id(p) for p in every} - {id(p) for p in kept} == head and len(head) == 2


# ------------------------------------------------------------------------------------- normalised state matching
def test_state_norms():
    """Normalised state losses ignore what a raw MSE is dominated by: a teacher's scale and offset."""
    from timm_odevit.distill import STATE_NORMS, state_matching_loss
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 4, 5, 16, generator=g), torch.randn(3, 4, 5, 16, generator=g)
    assert set(STATE_NORMS) == {'none', 'layernorm', 'cosine', 'standardize', 'gram'}
    for norm in STATE_NORMS:
        assert float(state_matching_loss(t, t, norm)) == pytest.approx(0., abs=1e-5)
    big = 10 * t + 3
    assert float(state_matching_loss(s, big)) > 50 * float(state_matching_loss(s, t))  # raw: scale dominates
    # (to LayerNorm's eps)
    torch.testing.assert_close(state_matching_loss(s, big, 'layernorm'), state_matching_loss(s, t, 'layernorm'),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state_matching_loss(s, 10 * t, 'cosine'), state_matching_loss(s, t, 'cosine'))
    # standardize: a student that matches the teacher up to its per-dimension statistics is close, not far
    assert float(state_matching_loss(big + 0.1 * s, big, 'standardize')) < 0.1
    with pytest.raises(ValueError, match='state norm'):
        state_matching_loss(s, t, 'l2')


def test_gram_state_norm_asks_for_the_teachers_relations_not_its_basis(batch):
    """'gram' compares how the images of a batch relate: a student whose states are the teacher's rotated, scaled
    and shifted has lost nothing (every other distance says it is far), one that relates them otherwise is far; a
    batch of one image has no relations to compare and is refused by name."""
    from timm_odevit.distill import state_matching_loss
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 8, 5, 16, generator=g), torch.randn(3, 8, 5, 16, generator=g)
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=g))
    turned = 3 * t @ rotation + 2
    assert float(state_matching_loss(turned, t, 'gram')) == pytest.approx(0., abs=1e-5)
    for norm in ('layernorm', 'cosine', 'standardize'):
        assert float(state_matching_loss(turned, t, norm)) > 0.5 * float(state_matching_loss(s, t, norm))
    torch.testing.assert_close(state_matching_loss(s @ rotation, t, 'gram'), state_matching_loss(s, t, 'gram'))
    assert float(state_matching_loss(s, t, 'gram')) > 0.1
    with pytest.raises(ValueError, match='batch of at least 2'):
        state_matching_loss(s[:, :1], t[:, :1], 'gram')
    # through the task: a gradient reaches the student, and its per-target gaps are those the loss sums
    x, y = batch
    task = TrajectoryDistillationTask(make_student(), make_teacher(), state_norm='gram', verbose=False)
    out = task(x, y)
    out['state_loss'].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in task.trainable_module_student().parameters())
    torch.testing.assert_close(task.state_gaps(x).sum(), out['state_loss'].detach(), rtol=1e-4, atol=1e-5)


def test_distill_terms_decay_to_zero_at_their_end_epoch(batch):
    """With distill_end_epoch the teacher's terms fade linearly; after it the loss is the label loss alone."""
    x, y = batch
    task = TrajectoryDistillationTask(make_student(), make_teacher(), state_norm='layernorm', kd_loss_weight=1.,
                                      distill_end_epoch=4, verbose=False)
    scales = []
    for epoch in (0, 2, 4, 6):
        task.set_epoch(epoch)
        scales.append(task.distill_scale())
    assert scales == [1., .5, 0., 0.]
    out = task(x, y)
    assert float(out['state_loss']) > 0 and float(out['kd_loss']) > 0
    torch.testing.assert_close(out['loss'], out['task_loss'])
    with pytest.raises(ValueError, match='distill_end_epoch'):
        TrajectoryDistillationTask(make_student(), make_teacher(), distill_end_epoch=0, verbose=False)
    with pytest.raises(ValueError, match='state_norm'):
        TrajectoryDistillationTask(make_student(), make_teacher(), state_norm='l2', verbose=False)


def test_command_state_norm_schedule_and_kd_default(image_folder, tmp_path):
    """--state-norm and --distill-end-epoch reach the task, whose state norm defaults to LayerNorm in the command and
    the task alike; logit KD is on by default when the teacher classifies into the student's classes (its logits
    then mean something for the student)."""
    from timm_odevit_tools.train.command import build_task, parse_args
    assert build_task(parse_args(command(image_folder, str(tmp_path))), torch.device('cpu')).state_norm == 'layernorm'
    assert TrajectoryDistillationTask(make_student(), make_teacher(), verbose=False).state_norm == 'layernorm'
    args = parse_args(command(image_folder, str(tmp_path), '--state-norm', 'cosine', '--distill-end-epoch', '3'))
    task = build_task(args, torch.device('cpu'))
    assert task.state_norm == 'cosine' and task.distill_end_epoch == 3 and task.kd_loss_weight == 1.
    args = parse_args(command(image_folder, str(tmp_path), '--teacher-kwargs', 'img_size=32', 'patch_size=4',
                              'depth=3', 'num_classes=5', '--no-init-from-teacher'))
    assert build_task(args, torch.device('cpu')).kd_loss_weight == 0.


def test_command_keeps_initial_checkpoint_weights_whole(image_folder, tmp_path):
    """A guided run that starts from earlier weights (--initial-checkpoint, a next stage) keeps their stem and head:
    the teacher's are copied into a fresh student only."""
    import timm
    from safetensors.torch import save_file
    from timm_odevit_tools.train.command import build_task, parse_args
    fresh = build_task(parse_args(command(image_folder, str(tmp_path))), torch.device('cpu'))
    assert 'patch_embed.proj.weight' in guidance_summary(fresh)['copied_from_teacher']
    torch.manual_seed(1)
    earlier = timm.create_model('odevit_tiny_patch4_32', depth=3, num_classes=3, in_chans=3)
    path = str(tmp_path / 'earlier.safetensors')
    save_file(earlier.state_dict(), path)
    args = parse_args(command(image_folder, str(tmp_path), '--initial-checkpoint', path))
    task = build_task(args, torch.device('cpu'))
    assert guidance_summary(task)['copied_from_teacher'] == []
    student = task.get_eval_model()
    for name in ('patch_embed.proj.weight', 'head.weight', 'cls_token'):
        assert torch.equal(student.state_dict()[name], earlier.state_dict()[name]), name


def test_command_attention_term_defaults_off_for_a_teacher_without_maps(image_folder, tmp_path):
    """An SSoG teacher has no attention maps: the CLS-attention term defaults to 0 (JaSMin, on the student's own
    maps, stays on); asked for explicitly, it is refused with the reason."""
    from timm_odevit_tools.train.command import build_task, parse_args
    argv = command(image_folder, str(tmp_path))
    i = argv.index('--teacher')
    argv[i + 1] = 'ssog_vit_tiny_patch4_32'
    args = parse_args(argv)
    task = build_task(args, torch.device('cpu'))
    assert task.attn_loss_weight == 0. and task.jasmin_weight == 1. and task.state_loss_weight == 0.5
    assert guidance_summary(task)['weights']['attention'] == 0.
    with pytest.raises(ValueError, match='the teacher has none'):
        build_task(parse_args(argv + ['--attn-weight', '0.25']), torch.device('cpu'))


def logit_command(image_folder: str, out: str, *extra: str) -> list:
    """A discrete ViT student guided by a CNN teacher: the DeiT setting, logit KD alone."""
    argv = command(image_folder, out, *extra)
    argv[argv.index('odevit_tiny_patch4_32')] = 'dense_vit_tiny_patch4_32'
    i = argv.index('--teacher')
    argv[i + 1:i + 6] = ['resnet10t', '--teacher-kwargs', 'num_classes=3']
    return argv


def test_command_logit_kd_from_a_cnn_teacher(image_folder, tmp_path):
    """--distill logit: timm's LogitDistillationTask with the command's KD options; the teacher stays as loaded, the
    record and the card say logit KD, and the per-epoch summary logs the two terms."""
    from timm.task import LogitDistillationTask
    from timm_odevit_tools.hub.card import guidance_line
    from timm_odevit_tools.train.command import build_task, parse_args
    torch.manual_seed(0)
    cnn = timm.create_model('resnet10t', num_classes=3)
    teacher = tmp_path / 'cnn.pth'
    torch.save(cnn.state_dict(), teacher)
    argv = logit_command(image_folder, str(tmp_path), '--distill', 'logit', '--teacher-checkpoint', str(teacher),
                         '--kd-temperature', '2', '--epochs', '1', '--max-steps-per-epoch', '2')
    task = build_task(parse_args(argv), torch.device('cpu'))
    assert isinstance(task, LogitDistillationTask)
    assert (task.temperature, task.distill_loss_weight, task.task_loss_weight) == (2., 1., 1.)
    results = train_main(argv)
    assert results['guidance']['mode'] == 'logit' and results['guidance']['kd_temperature'] == 2.
    with open(tmp_path / 'run' / 'summary.csv') as f:
        row = next(csv.DictReader(f))
    assert float(row['train_kd_loss']) > 0 and float(row['train_task_loss']) > 0
    ckpt = torch.load(tmp_path / 'run' / 'last.pth.tar', map_location='cpu', weights_only=False)
    assert not any(k.startswith('teacher') for k in ckpt['state_dict'])  # the student alone is saved
    line = guidance_line({'teacher': 'resnet10t', 'distill': 'logit', 'kd_temperature': 2.}, results['guidance'])
    assert 'logit KD alone' in line and '1 x logit KD (T=2)' in line


def test_command_refuses_what_a_distillation_mode_cannot_do(image_folder, tmp_path, capsys):
    """A CNN teacher cannot guide a trajectory (no class token): the error points to --distill logit; logit KD
    refuses the trajectory options (they would be silently ignored) and a teacher of other classes."""
    from timm_odevit_tools.train.command import build_task, parse_args
    with pytest.raises(ValueError, match='Use --distill logit'):
        build_task(parse_args(logit_command(image_folder, str(tmp_path))), torch.device('cpu'))
    with pytest.raises(SystemExit):
        parse_args(logit_command(image_folder, str(tmp_path), '--distill', 'logit', '--state-weight', '0.3',
                                 '--times', 'paper'))
    assert '--times, --state-weight steer trajectory distillation' in capsys.readouterr().err
    argv = logit_command(image_folder, str(tmp_path), '--distill', 'logit')
    argv[argv.index('num_classes=3')] = 'num_classes=5'
    with pytest.raises(ValueError, match='the teacher predicts 5 classes, the student 3'):
        build_task(parse_args(argv), torch.device('cpu'))
