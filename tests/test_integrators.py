"""Depth integrators: agreement between discrete, looped and ODE trunks, NFE, solver settings and failures."""
import pytest
import torch

from timm_odevit.layers import FieldBlock, LoopedDepth, OdeDepth, OdeSolverError

GRID = (3, 3)


def _block(seed=0, mixer='ssog'):
    torch.manual_seed(seed)
    return FieldBlock(16, 2, mixer=mixer, mlp_ratio=2).eval()


def _tokens(seed=1):
    return torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(seed))


class CountingBlock(torch.nn.Module):
    """Counts calls independently of the integrator's own nfe."""

    def __init__(self, block):
        super().__init__()
        self.block = block
        self.calls = 0

    def forward(self, x, grid_size):
        self.calls += 1
        return self.block(x, grid_size)


@pytest.mark.parametrize('mixer', ['ssog', 'attention'])
def test_ode_euler_unit_step_equals_looped(mixer):
    block = _block(mixer=mixer)
    x = _tokens()
    looped, looped_states = LoopedDepth(block, 6)(x, GRID, take_indices=[1, 5])
    ode, ode_states = OdeDepth(block, num_layers=6, method='euler')(x, GRID, take_indices=[1, 5])
    torch.testing.assert_close(ode, looped, rtol=1e-6, atol=1e-6)
    for a, b in zip(ode_states, looped_states):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('method,steps,expected', [('euler', 12, 12), ('midpoint', 6, 12), ('rk4', 6, 24),
                                                    ('rk4', 3, 12), ('heun3', 4, 12)])
def test_fixed_grid_nfe(method, steps, expected):
    block = CountingBlock(_block())
    depth = OdeDepth(block, num_layers=12, method=method, steps=steps)
    with torch.no_grad():
        depth(_tokens(), GRID)
    assert depth.nfe == expected == block.calls
    block.calls = 0
    with torch.no_grad():  # intermediates come from the same solve, not extra ones
        _, states = depth(_tokens(), GRID, take_indices=list(range(12)))
    assert len(states) == 12 and depth.nfe == expected == block.calls


def test_adaptive_nfe_counts_every_evaluation():
    block = CountingBlock(_block())
    depth = OdeDepth(block, num_layers=4, method='dopri5', rtol=1e-3, atol=1e-4)
    with torch.no_grad():
        out, _ = depth(_tokens(), GRID)
    assert depth.nfe == block.calls > 0
    # dopri5 spends 6 new evaluations per step (FSAL) plus the initial ones
    assert (depth.nfe - 2) % 6 == 0
    ref, _ = OdeDepth(block, num_layers=4, method='rk4', steps=64)(_tokens(), GRID)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


def test_set_solver_on_built_depth():
    depth = OdeDepth(_block(), num_layers=12, method='euler')
    depth.set_solver(method='rk4', steps=6)
    with torch.no_grad():
        out, _ = depth(_tokens(), GRID)
    assert depth.nfe == 24 and torch.isfinite(out).all()
    assert depth.method == 'rk4' and depth.steps == 6
    with pytest.raises(ValueError, match='Unknown ODE method'):
        depth.set_solver(method='rk45')
    with pytest.raises(ValueError, match='positive integer'):
        depth.set_solver(steps=0)
    with pytest.raises(ValueError, match='positive integer'):
        depth.set_solver(steps=2.5)
    with pytest.raises(ValueError, match='rtol and atol'):
        depth.set_solver(rtol=-1)
    assert depth.method == 'rk4' and depth.steps == 6  # a refused change leaves the solver as it was


def test_solver_context_sets_and_restores_the_options_however_it_ends():
    depth = OdeDepth(_block(), num_layers=12, method='euler', max_nfe=500)
    before = depth.solver_options()
    assert before == dict(method='euler', steps=12, rtol=1e-3, atol=1e-4, adjoint=False, max_nfe=500)
    with depth.solver(method='rk4', steps=6) as solved:
        assert solved is depth and (depth.method, depth.steps) == ('rk4', 6)
        with torch.no_grad():
            depth(_tokens(), GRID)
        assert depth.nfe == 24
    assert depth.solver_options() == before
    with pytest.raises(RuntimeError, match='inside'):
        with depth.solver(steps=3):
            raise RuntimeError('inside')
    assert depth.solver_options() == before
    with pytest.raises(ValueError, match='Unknown ODE method'):
        with depth.solver(method='rk45'):
            pass
    assert depth.solver_options() == before


def test_adaptive_nonfinite_state_stops_with_clear_error():
    block = _block()
    with torch.no_grad():
        block.mlp.fc2.weight[0, 0] = float('inf')
    depth = OdeDepth(block, num_layers=4, method='dopri5')
    with pytest.raises(OdeSolverError, match='non-finite'):
        with torch.no_grad():
            depth(_tokens(), GRID)


def test_adaptive_nfe_cap_stops_with_clear_error():
    block = _block()
    with torch.no_grad():
        for p in block.parameters():
            if p.ndim == 2:
                p.mul_(8)  # stiff, fast dynamics: tight tolerances need many steps
    depth = OdeDepth(block, num_layers=4, method='dopri5', rtol=1e-9, atol=1e-9, max_nfe=50)
    with pytest.raises(OdeSolverError, match='max_nfe=50'):
        with torch.no_grad():
            depth(_tokens(), GRID)
    assert depth.nfe == 51


def test_solve_times_are_validated():
    depth = OdeDepth(_block(), num_layers=4)
    for bad in ([2.0, 1.0], [0.0, 1.0], [1.0, 5.0], []):
        with pytest.raises(ValueError, match='times'):
            depth.solve(_tokens(), GRID, torch.tensor(bad))
    states = depth.solve(_tokens(), GRID, torch.tensor([0.5, 2.0, 4.0]))
    assert states.shape == (3, 2, 10, 16)


def test_adjoint_gradients_match_backprop():
    x = _tokens()
    grads = []
    for adjoint in (False, True):
        block = _block().double()
        depth = OdeDepth(block, num_layers=2, method='rk4', steps=8, adjoint=adjoint)
        out, _ = depth(x.double(), GRID)
        out.square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in block.parameters()]))
        if adjoint:
            assert depth.nfe_backward > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('method', ['euler', 'dopri5'])
def test_grad_checkpointing_same_gradients(method):
    x = _tokens()
    grads = []
    for ckpt in (False, True):
        block = _block().train()
        calls = []
        # a pre-hook: torch's recomputation stops once it has what the backward needs, before any post-hook
        block.register_forward_pre_hook(lambda *_: calls.append(1))
        depth = OdeDepth(block, num_layers=3, method=method)
        depth.set_grad_checkpointing(ckpt)
        out, _ = depth(x, GRID)
        forward_calls = len(calls)
        out.sum().backward()
        # checkpointing keeps no activations inside the block: the backward pass runs the evaluations it needs again
        # (all of them on a fixed grid; an adaptive solve's last, unused one not)
        recomputed = len(calls) - forward_calls
        assert (0 < recomputed <= forward_calls) if ckpt else recomputed == 0
        assert not ckpt or recomputed == forward_calls or method == 'dopri5'
        grads.append(torch.cat([p.grad.flatten() for p in block.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize('steps', [12, 5, 7])
def test_prune_keeps_the_first_layers(steps):
    """Pruned or not, the trunk's outputs at the kept layers are the same solve on the same grid points, also when
    the solver grid is not a multiple of the layers."""
    depth = OdeDepth(_block(), num_layers=12, steps=steps)
    with torch.no_grad():
        _, full = depth(_tokens(), GRID, take_indices=[2, 4])
        _, early = depth(_tokens(), GRID, take_indices=[2, 4], stop_early=True)
        depth.prune(5)
        out, pruned = depth(_tokens(), GRID, take_indices=[2, 4])
    assert depth.steps == steps and depth.t_end == 5.0 and depth.num_layers == 5
    torch.testing.assert_close(out, full[1])
    for a, b, c in zip(pruned, full, early):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)


def _torchdiffeq_reference(depth, x, times):
    """torchdiffeq's own solver on our grid: the library path the plain loop must reproduce."""
    from timm_odevit.layers.integrators import field_constants
    return depth._solve_torchdiffeq(x, GRID, list(times), field_constants(depth.block, GRID, x))


@pytest.mark.parametrize('method,steps', [('euler', 12), ('midpoint', 5), ('heun2', 4), ('heun3', 7), ('rk4', 5)])
def test_fixed_grid_loop_matches_torchdiffeq(method, steps):
    """Same outputs, gradients and last evaluated state as torchdiffeq's odeint on the same grid, at solver points
    and between them."""
    x = _tokens().double().requires_grad_()
    block = _block().double()
    depth = OdeDepth(block, num_layers=12, method=method, steps=steps)
    times = [1.0, 2.5, 7.0, 12.0]  # 2.5 falls between the points of every grid here: linear interpolation
    results = []
    for solve in (lambda: depth.solve(x, GRID, times, return_last_input=True),
                  lambda: _torchdiffeq_reference(depth, x, times)):
        out, last_input = solve()
        nfe = depth.nfe
        grads = torch.autograd.grad(out.square().sum(), [x] + list(block.parameters()))
        results.append((out.detach(), grads, nfe, last_input.detach()))
    (ours, our_grads, our_nfe, our_last), (ref, ref_grads, ref_nfe, ref_last) = results
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(our_last, ref_last, rtol=1e-10, atol=1e-10)
    assert not torch.equal(our_last, x.detach())
    for a, b in zip(our_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert our_nfe == ref_nfe


def test_field_constants_computed_once_per_forward():
    """The Gaussian kernels are built once per solve, not once per field evaluation (with autograd on: without it,
    an unchanged mixer keeps them across forwards, tests/test_layers.py)."""
    block = _block()
    calls = []
    kernels = block.mixer.kernels
    block.mixer.kernels = lambda grid_size: calls.append(grid_size) or kernels(grid_size)
    depth = OdeDepth(block, num_layers=12, method='rk4', steps=6)
    depth(_tokens(), GRID)
    assert depth.nfe == 24 and calls == [GRID]
    calls.clear()
    LoopedDepth(block, 6)(_tokens(), GRID)
    assert calls == [GRID]


def test_fixed_grid_cost_refused_early():
    """A fixed grid whose evaluations exceed max_nfe is refused when set, with advice that applies to it."""
    with pytest.raises(ValueError, match='4000000 function evaluations.*fewer steps, or raise max_nfe'):
        OdeDepth(_block(), num_layers=12, method='rk4', steps=10 ** 6)
    depth = OdeDepth(_block(), num_layers=12, method='rk4', steps=250)  # 1000 evaluations: at the cap, accepted
    assert depth.steps == 250
    depth.set_solver(steps=400, max_nfe=1600)
    assert depth.max_nfe == 1600


def test_solver_numbers_validated():
    import numpy as np
    depth = OdeDepth(_block(), num_layers=4, steps=np.int64(8))  # numpy integers are integers
    assert depth.steps == 8 and type(depth.steps) is int
    with pytest.raises(ValueError, match='positive integer'):
        depth.set_solver(steps=True)
    for bad in (float('inf'), float('nan'), -1.0, 0.0):
        with pytest.raises(ValueError, match='t_end'):
            OdeDepth(_block(), num_layers=4, t_end=bad)
    with pytest.raises(ValueError, match='rtol and atol'):
        depth.set_solver(rtol=float('inf'))


@pytest.mark.parametrize('method', ['dopri5', 'rk4'])
def test_empty_batch_gives_an_empty_result(method):
    """An empty batch has nothing to solve, adaptive or not: an empty result, not a collapsed step."""
    depth = OdeDepth(_block(), num_layers=2, method=method)
    x = torch.zeros(0, 10, 16)
    with torch.no_grad():
        out, states = depth(x, GRID, take_indices=[0])
    assert out.shape == x.shape and states[0].shape == x.shape
