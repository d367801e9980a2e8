"""Trajectory distillation in timm's task API: a discrete teacher's block outputs guide an ODE (or looped) student's
states along its depth, from one solve per batch."""
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import group_parameters
from timm.task import DistillationTeacher, TrainingTask
from timm.task.classification import resolve_classification_loss
from timm.utils import unwrap_model

from ..models import DepthVisionTransformer
from .init import COPYABLE_PARTS, copy_from_teacher
from .losses import STATE_NORMS, cls_attention_loss, jasmin_loss, logit_kd_loss, state_matching_loss
from .times import TIME_RULES, cls_distances, paper_times, solver_grid, trunk_t_end, uniform_times, validate_times

__all__ = ['TrajectoryDistillationTask', 'TrajectoryTrainableModule', 'find_attention_module', 'attention_from_qkv',
           'LOSS_KEYS']

_logger = logging.getLogger(__name__)

STATE_TOKENS = ('cls', 'all')
# every loss term is returned (zero when off) so a training loop can log a fixed set of columns
LOSS_KEYS = ('state_loss', 'attn_loss', 'kd_loss', 'task_loss', 'jasmin_loss')


def find_attention_module(model: nn.Module) -> Optional[nn.Module]:
    """The last softmax attention with a fused ``qkv`` Linear (timm's ``Attention``, our ``MultiHeadAttention``):
    in a ViT that is the last block's attention."""
    found = None
    for module in model.modules():
        if isinstance(getattr(module, 'qkv', None), nn.Linear) and isinstance(getattr(module, 'num_heads', None), int):
            found = module
    return found


def attention_from_qkv(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Recompute softmax attention maps [B, heads, N, N] from an attention module's input.

    timm's ``Attention`` runs fused SDPA and never forms its maps, so they are rebuilt from the same ``qkv``,
    q/k norms and scale the module uses.
    """
    B, N, _ = x.shape
    heads = attn.num_heads
    head_dim = getattr(attn, 'head_dim', None) or attn.qkv.out_features // (3 * heads)
    q, k, _ = attn.qkv(x).reshape(B, N, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q = getattr(attn, 'q_norm', nn.Identity())(q)
    k = getattr(attn, 'k_norm', nn.Identity())(k)
    scale = getattr(attn, 'scale', head_dim ** -0.5)
    return ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)


def _block_input_module(model: nn.Module) -> Optional[nn.Module]:
    """The module whose input is the token state before the first block (for the paper's time rule)."""
    blocks = getattr(model, 'blocks', None)
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks):
        return blocks[0]
    return getattr(model, 'trunk', None)


def _num_prefix_tokens(model: nn.Module) -> int:
    return int(getattr(model, 'num_prefix_tokens', 0) or 0)


def _has_cls(model: nn.Module) -> bool:
    return getattr(model, 'cls_token', None) is not None


def _select_tokens(cls: torch.Tensor, patches: torch.Tensor, state_tokens: str) -> torch.Tensor:
    """[..., D] CLS and [..., N, D] patches -> the matched part: CLS only, or CLS followed by patches."""
    if state_tokens == 'cls':
        return cls
    return torch.cat([cls.unsqueeze(-2), patches], dim=-2)


class TrajectoryTrainableModule(nn.Module):
    """Student and projection, with every trainable op inside ``forward`` so that DDP sees all of it."""

    def __init__(self, student_model: nn.Module, projection: Optional[nn.Module] = None, state_tokens: str = 'cls'):
        super().__init__()
        self.student = student_model
        self.projection = projection
        self.state_tokens = state_tokens

    def no_weight_decay(self) -> set:
        student = unwrap_model(self.student)
        return {'student.' + name for name in student.no_weight_decay()} if hasattr(student, 'no_weight_decay') \
            else set()

    def group_matcher(self, coarse: bool = False) -> Any:
        student = unwrap_model(self.student)
        layer_map = group_parameters(student, student.group_matcher(coarse=coarse), reverse=True)
        task_layer = max(layer_map.values(), default=0)

        def _matcher(name: str) -> int:
            return layer_map.get(name[len('student.'):], task_layer) if name.startswith('student.') else task_layer

        return _matcher

    def forward(
            self,
            input: torch.Tensor,
            times: Union[torch.Tensor, Sequence[float]],
            return_attn: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(student logits, matched states [K, B, D] or [K, B, 1 + N, D] projected to the teacher's width, and the
        last field evaluation's attention maps or None)."""
        final, states, attn = self.student.forward_trajectory(input, times, return_attn=return_attn)
        logits = self.student.forward_head(final)
        npt = self.student.num_prefix_tokens
        states = _select_tokens(states[:, :, 0], states[:, :, npt:], self.state_tokens)
        if self.projection is not None:
            states = self.projection(states)
        return logits, states, attn


def _check_options(state_tokens: str, times: Union[str, Sequence[float]], state_norm: str,
               distill_end_epoch: Optional[int], kd_temperature: float, weights: Dict[str, float]) -> None:
    """Refuse a bad option of TrajectoryDistillationTask before any model work, naming it."""
    if state_tokens not in STATE_TOKENS:
        raise ValueError(f'state_tokens must be one of {STATE_TOKENS}, got {state_tokens!r}.')
    if isinstance(times, str) and times not in TIME_RULES:
        raise ValueError(f'times must be one of {TIME_RULES} or a list of times, got {times!r}.')
    for name, value in weights.items():
        if not value >= 0:
            raise ValueError(f'{name} must be >= 0, got {value}.')
    if state_norm not in STATE_NORMS:
        raise ValueError(f'state_norm must be one of {STATE_NORMS}, got {state_norm!r}.')
    if distill_end_epoch is not None and distill_end_epoch < 1:
        raise ValueError(f'distill_end_epoch (--distill-end-epoch) must be at least 1, or None for the whole run, '
                         f'got {distill_end_epoch}.')
    if not kd_temperature > 0:
        raise ValueError(f'kd_temperature must be > 0, got {kd_temperature}.')


class TrajectoryDistillationTask(TrainingTask):
    """A teacher with ``forward_intermediates`` guides the depth trajectory of a ``DepthVisionTransformer`` student.

    The teacher's block outputs (before its final norm) are targets at student depth times: ``times='uniform'``,
    ``'paper'`` (ODE-ViT's rule, from how far each teacher block moves the CLS token, calibrated once on the first
    batch, or on ``calibration_input``), or an explicit list. Student states at all targets come from one solve.

    Loss = state_loss_weight * sum_k MSE(states) + attn_loss_weight * L1(CLS attention, last layer)
    + kd_loss_weight * KL(logits / T) + task_loss_weight * CE (from ``task_loss_start_epoch``)
    + jasmin_weight * JaSMin(student attention). Each term is returned for logging.

    Args:
        student_model: an ODE, looped (or discrete) ``DepthVisionTransformer``.
        teacher_model: a timm model name (pretrained weights are loaded, e.g. ``hf-hub:org/repo``), a module, or a
            ``DistillationTeacher``; it must have ``forward_intermediates``. It is frozen and never trained.
        criterion, criterion_kwargs: label loss (timm's classification loss by default).
        teacher_pretrained_path: checkpoint file for a teacher given by name.
        teacher_indices: which teacher blocks are targets (timm's ``indices``: n = last n, a list, None = all).
        times: 'uniform', 'paper', or one time per target in the student's depth units (0, t_end].
        state_tokens: match the CLS token only ('cls', as the paper) or CLS and all patch tokens ('all').
        state_norm: what the state loss compares (``losses.STATE_NORMS``): 'layernorm' (the default: both states
            LayerNorm'd without affine parameters, so the loss's scale does not depend on the teacher's state norm),
            'none' the raw MSE (the paper), 'cosine', 'standardize' or 'gram' (the batch's similarity matrices,
            blind to a rotation of the student's states; see ``state_matching_loss``).
        state_loss_weight, attn_loss_weight, kd_loss_weight, task_loss_weight, jasmin_weight: term weights.
        kd_temperature: logit KD temperature.
        task_loss_start_epoch: first epoch (see ``set_epoch``) at which the label loss counts (paper: 200 of 300).
        distill_end_epoch: the teacher's terms (state, attention, KD, JaSMin) decay linearly from full weight at
            epoch 0 to 0 at this epoch, leaving the label loss alone after it (None: they never decay).
        jasmin_k: JaSMin's k (log(g_1/g_k); 0 gives log g_1).
        jasmin_detach: compute JaSMin on detached maps, as ODE-ViT's released code (logged, no gradient).
        init_from_teacher: copy these teacher parts into the student (True = all of ``COPYABLE_PARTS``).
        freeze_copied: freeze the copied parts.
        calibration_input: a batch (normalised for the student) to calibrate the 'paper' rule at construction.
    """

    def __init__(
            self,
            student_model: nn.Module,
            teacher_model: Union[str, nn.Module, DistillationTeacher],
            criterion: Optional[nn.Module] = None,
            criterion_kwargs: Optional[Dict[str, Any]] = None,
            teacher_pretrained_path: Optional[str] = None,
            teacher_indices: Optional[Union[int, List[int]]] = None,
            times: Union[str, Sequence[float]] = 'uniform',
            state_tokens: str = 'cls',
            state_norm: str = 'layernorm',
            state_loss_weight: float = 0.5,
            attn_loss_weight: float = 0.25,
            kd_loss_weight: float = 0.,
            kd_temperature: float = 1.,
            task_loss_weight: float = 1.,
            task_loss_start_epoch: int = 0,
            distill_end_epoch: Optional[int] = None,
            jasmin_weight: float = 1.,
            jasmin_k: int = 2,
            jasmin_detach: bool = False,
            init_from_teacher: Union[bool, Sequence[str]] = True,
            freeze_copied: bool = False,
            calibration_input: Optional[torch.Tensor] = None,
            device: Optional[torch.device] = None,
            dtype: Optional[torch.dtype] = None,
            verbose: bool = True,
    ) -> None:
        super().__init__(device=device, dtype=dtype, verbose=verbose)
        student = unwrap_model(student_model)
        if not isinstance(student, DepthVisionTransformer):
            raise TypeError(f'The student must be a timm_odevit DepthVisionTransformer (odevit_*, ssog_ode_*, '
                            f'looped_*), got {type(student).__name__}.')
        _check_options(state_tokens, times, state_norm, distill_end_epoch, kd_temperature, dict(
            state_loss_weight=state_loss_weight, attn_loss_weight=attn_loss_weight, kd_loss_weight=kd_loss_weight,
            task_loss_weight=task_loss_weight, jasmin_weight=jasmin_weight))

        self.teacher = self._fixed_teacher(teacher_model, student, teacher_pretrained_path)
        t_model = unwrap_model(self.teacher.model)
        self.criterion = resolve_classification_loss(criterion, self.device, criterion_kwargs=criterion_kwargs)

        self.teacher_indices = teacher_indices
        self.state_tokens = state_tokens
        self.state_norm = state_norm
        self.distill_end_epoch = distill_end_epoch
        self.state_loss_weight = state_loss_weight
        self.attn_loss_weight = attn_loss_weight
        self.kd_loss_weight = kd_loss_weight
        self.kd_temperature = kd_temperature
        self.task_loss_weight = task_loss_weight
        self.task_loss_start_epoch = task_loss_start_epoch
        self.jasmin_weight = jasmin_weight
        self.jasmin_k = jasmin_k
        self.jasmin_detach = jasmin_detach
        self.epoch = 0

        cfg = getattr(student, 'pretrained_cfg', None) or {}
        mean = torch.tensor(cfg.get('mean', IMAGENET_DEFAULT_MEAN), device=self.device, dtype=self.dtype)
        std = torch.tensor(cfg.get('std', IMAGENET_DEFAULT_STD), device=self.device, dtype=self.dtype)
        self.register_buffer('student_mean', mean.view(1, -1, 1, 1), persistent=False)
        self.register_buffer('student_std', std.view(1, -1, 1, 1), persistent=False)

        num_targets, t_width = self._probe_teacher(student, t_model, state_tokens, attn_loss_weight, jasmin_weight,
                                                   kd_loss_weight)
        self.num_targets = num_targets

        self._place_targets(student, t_model, times, num_targets, calibration_input)

        # --- plug-and-play start and the width adapter
        parts = COPYABLE_PARTS if init_from_teacher is True else tuple(init_from_teacher or ())
        self.copied_params = copy_from_teacher(student, t_model, parts, freeze=freeze_copied) if parts else []
        s_width = student.embed_dim
        projection = None
        if s_width != t_width and state_loss_weight > 0:
            # only when used: DDP rejects parameters that never receive a gradient
            projection = nn.Linear(s_width, t_width, device=self.device, dtype=self.dtype)
        self.trainable_module = TrajectoryTrainableModule(student_model, projection, state_tokens)
        if self.verbose:
            shown = 'after calibration' if self.target_times is None else self.target_times.tolist()
            _logger.info(f'TrajectoryDistillationTask: {num_targets} teacher targets at times {shown} (rule '
                         f'{self.time_rule}), widths {s_width}->{t_width}, copied {self.copied_params}')

    def _fixed_teacher(self, teacher_model: Union[str, nn.Module, DistillationTeacher], student: nn.Module,
                       teacher_pretrained_path: Optional[str]) -> DistillationTeacher:
        """The teacher on the task's device, frozen and in eval mode."""
        if isinstance(teacher_model, DistillationTeacher):
            teacher = teacher_model
        else:
            teacher = DistillationTeacher(
                teacher_model, num_classes=student.num_classes, in_chans=student.in_chans,
                pretrained_path=teacher_pretrained_path, device=self.device, dtype=self.dtype)
        # a teacher given as a module may sit on another device: the probe below and every step run on the task's
        teacher.to(device=self.device)
        t_model = unwrap_model(teacher.model)
        if not callable(getattr(t_model, 'forward_intermediates', None)):
            raise TypeError(f'The teacher ({type(t_model).__name__}) has no forward_intermediates(): trajectory '
                            'distillation needs its block outputs. Use a timm ViT-family model.')
        # the teacher is a fixed target: no gradients, no optimizer, no train-mode behaviour (dropout, BN stats)
        for p in teacher.parameters():
            p.requires_grad_(False)
        teacher.eval()
        return teacher

    def _probe_teacher(self, student: nn.Module, t_model: nn.Module, state_tokens: str, attn_loss_weight: float,
                       jasmin_weight: float, kd_loss_weight: float) -> Tuple[int, int]:
        """What each side can give, from the teacher run once on a blank image of the student's size: the number of
        targets and the teacher's width; a loss term one side cannot feed fails here."""
        if not (_has_cls(student) and _has_cls(t_model)):
            raise ValueError('Trajectory distillation matches CLS states: teacher and student both need a class token.')
        self.teacher_prefix_tokens = _num_prefix_tokens(t_model)
        self._teacher_attn = find_attention_module(t_model)
        student_mixer = student.trunk.field_blocks()[-1].mixer
        student_maps = bool(getattr(student_mixer, 'supports_attn_maps', False))
        if attn_loss_weight > 0 and (not student_maps or self._teacher_attn is None):
            side = 'student mixer (' + type(student_mixer).__name__ + ')' if not student_maps else 'teacher'
            raise ValueError(f'attn_loss_weight > 0 needs attention maps from both models, but the {side} has none; '
                             'set attn_loss_weight=0 (the training command: --attn-weight 0), e.g. for an SSoG '
                             'student.')
        if jasmin_weight > 0 and not student_maps:
            raise ValueError(f'JaSMin regularises softmax attention; the student mixer {type(student_mixer).__name__} '
                             'has none. Set jasmin_weight=0 (the training command: --jasmin-weight 0).')
        probe = torch.zeros(1, student.in_chans, *student.patch_embed.img_size, device=self.device, dtype=self.dtype)
        probe_t = self._teacher_forward(self.teacher.normalize_input(probe, self.student_mean, self.student_std),
                                        need_attn=attn_loss_weight > 0)
        num_targets = probe_t['states'].shape[0]
        t_width = probe_t['states'].shape[-1]
        t_patches = probe_t['patches']
        s_patches = student.patch_embed.num_patches
        if (state_tokens == 'all' or attn_loss_weight > 0) and t_patches != s_patches:
            raise ValueError(f'Teacher has {t_patches} patch tokens, the student {s_patches}: all-token states and '
                             'attention maps need the same patch grid (same image and patch size).')
        t_classes = probe_t['logits'].shape[-1]
        if kd_loss_weight > 0 and t_classes != student.num_classes:
            raise ValueError(f'Logit KD needs the same classes: the teacher predicts {t_classes}, the student '
                             f'{student.num_classes}. Reset the teacher head (--teacher-kwargs num_classes=N) or '
                             'set kd_loss_weight=0 (--kd-weight 0).')
        return num_targets, t_width

    def _place_targets(self, student: nn.Module, t_model: nn.Module, times: Union[str, Sequence[float]],
                       num_targets: int, calibration_input: Optional[torch.Tensor]) -> None:
        """Where the targets sit on the student's depth axis (``target_times``; the 'paper' rule calibrates)."""
        self.t_end = trunk_t_end(student)
        self.grid = solver_grid(student)
        self.time_rule = times if isinstance(times, str) else 'list'
        self.target_times: Optional[torch.Tensor] = None
        if times == 'uniform':
            self.target_times = uniform_times(num_targets, self.t_end, self.grid)
        elif times == 'paper':
            if _block_input_module(t_model) is None:
                raise ValueError("The 'paper' time rule needs the teacher's state before its first block (a 'blocks' "
                                 'or trunk module); give the times explicitly.')
            # checked now so a bad grid fails before training, not at the first batch
            uniform_times(num_targets, self.t_end, self.grid)
            if calibration_input is not None:
                self.calibrate(calibration_input)
        else:
            self.target_times = validate_times(times, num_targets, self.t_end, self.grid)

    # ---------------------------------------------------------------- teacher side
    @torch.no_grad()
    def _teacher_forward(self, x: torch.Tensor, need_attn: bool = False, need_input: bool = False) -> Dict[str, Any]:
        t_model = self.teacher.model
        captured: Dict[str, torch.Tensor] = {}
        handles = []
        if need_attn:
            handles.append(self._teacher_attn.register_forward_pre_hook(
                lambda m, args: captured.__setitem__('attn_x', args[0])))
        if need_input:
            handles.append(_block_input_module(unwrap_model(t_model)).register_forward_pre_hook(
                lambda m, args: captured.setdefault('h0', args[0])))
        try:
            final, inter = t_model.forward_intermediates(
                x, indices=self.teacher_indices, return_prefix_tokens=True, norm=False, output_fmt='NLC')
        finally:
            for h in handles:
                h.remove()
        patches = torch.stack([p for p, _ in inter])
        cls = torch.stack([prefix[:, 0] for _, prefix in inter])
        out = {
            'states': _select_tokens(cls, patches, self.state_tokens),
            'cls': cls,
            'patches': patches.shape[2],
            'logits': t_model.forward_head(final),
            'attn': attention_from_qkv(self._teacher_attn, captured['attn_x']) if need_attn else None,
        }
        if need_input:
            out['h0_cls'] = captured['h0'][:, 0]
        return out

    @torch.no_grad()
    def calibrate(self, input: torch.Tensor) -> torch.Tensor:
        """Fix the 'paper' rule's times from a batch (normalised for the student); averaged over ranks under DDP."""
        t = self._teacher_forward(self.teacher.normalize_input(input, self.student_mean, self.student_std),
                                  need_input=True)
        cls_states = torch.cat([t['h0_cls'].unsqueeze(0), t['cls']])
        distances = cls_distances(cls_states).to(input.device)
        if dist.is_available() and dist.is_initialized():
            # every rank must put the targets at the same times
            distances = distances.float()
            dist.all_reduce(distances)
            distances = distances.double() / dist.get_world_size()
        self.target_times = paper_times(distances.cpu(), self.t_end, self.grid)
        if self.verbose:
            _logger.info(f"'paper' time rule: teacher CLS distances {[round(float(d), 4) for d in distances]} -> "
                         f'times {self.target_times.tolist()}')
        return self.target_times

    # ---------------------------------------------------------------- training-loop plumbing
    def set_epoch(self, epoch: int) -> None:
        """Tell the task the current epoch (the label loss starts at ``task_loss_start_epoch``)."""
        self.epoch = epoch

    def train(self, mode: bool = True) -> 'TrajectoryDistillationTask':
        super().train(mode)
        self.teacher.eval()
        return self

    def prepare_distributed(
            self,
            device_ids: Optional[list] = None,
            **ddp_kwargs: Any,
    ) -> 'TrajectoryDistillationTask':
        """Wrap student and projection in DDP; the frozen teacher stays unwrapped."""
        from torch.nn.parallel import DistributedDataParallel as DDP
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.trainable_module = DDP(self.trainable_module, device_ids=device_ids, **ddp_kwargs)
        return self

    def compile(
            self,
            backend: str = 'inductor',
            mode: Optional[str] = None,
            **compile_kwargs: Any,
    ) -> nn.Module:
        """Compile the student's training forward (student and projection) before DDP wrapping; the frozen
        teacher runs eagerly under no_grad. Returns the (uncompiled) student that validation uses."""
        self.trainable_module = torch.compile(self.trainable_module, backend=backend, mode=mode, **compile_kwargs)
        return self.get_eval_model()

    def get_eval_model(self, module: Optional[nn.Module] = None, ema: bool = False) -> Optional[nn.Module]:
        current = super().get_eval_model(module=module, ema=ema)
        # under DDP (.module) or torch.compile (._orig_mod) the student sits inside the wrapper
        trainable = unwrap_model(current) if current is not None else None
        if isinstance(trainable, TrajectoryTrainableModule):
            return trainable.student
        return current

    def get_task_state(self, module: Optional[nn.Module] = None, ema: bool = False) -> Dict[str, Any]:
        module = module if module is not None else self.get_trainable_module(ema=ema)
        if module is None:
            return {}
        state: Dict[str, Any] = {}
        trainable = unwrap_model(module)
        if trainable.projection is not None:
            state['projection'] = trainable.projection.state_dict()
        if self.target_times is not None:
            state['target_times'] = self.target_times.clone()
        return state

    def load_task_state(
            self,
            state: Optional[Dict[str, Any]],
            strict: bool = True,
            module: Optional[nn.Module] = None,
            ema: bool = False,
    ) -> None:
        if not state:
            return
        module = module if module is not None else self.get_trainable_module(ema=ema)
        if module is None:
            raise RuntimeError('Cannot load EMA task state before setup_ema().' if ema else
                               'Cannot load task state without a trainable module.')
        trainable = unwrap_model(module)
        if 'projection' in state:
            if trainable.projection is None:
                if strict:
                    raise RuntimeError('Checkpoint has a projection but this task has none.')
            else:
                trainable.projection.load_state_dict(state['projection'], strict=strict)
        if 'target_times' in state:
            # a resumed 'paper' run keeps its calibrated times instead of re-deriving them from another batch
            self.target_times = torch.as_tensor(state['target_times'], dtype=torch.float64).cpu()

    def get_clip_parameters(self, exclude_head: bool = False) -> List[nn.Parameter]:
        trainable = unwrap_model(self.trainable_module)
        student = trainable.student
        # the head by name (the model's classifier), not as "the last two parameters", which depends on module order
        head = {id(p) for p in student.get_classifier().parameters()} if exclude_head else set()
        params = [p for p in student.parameters() if id(p) not in head]
        if trainable.projection is not None:
            params.extend(trainable.projection.parameters())
        return params

    # ---------------------------------------------------------------- the step
    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Loss and its terms for one batch: 'loss', 'output' (student logits) and each of ``LOSS_KEYS``."""
        if self.target_times is None:
            self.calibrate(input)
        need_t_attn = self.attn_loss_weight > 0
        need_s_attn = need_t_attn or self.jasmin_weight > 0
        with torch.no_grad():
            input_kd = self.teacher.normalize_input(input, self.student_mean, self.student_std)
            t = self._teacher_forward(input_kd.detach(), need_attn=need_t_attn)
        # times go in as Python floats: the compiled student then traces as one graph (a tensor of times would be
        # read back inside it)
        logits, states, attn = self.trainable_module(input, self.target_times.tolist(), return_attn=need_s_attn)

        zero = logits.new_zeros(())
        terms = dict.fromkeys(LOSS_KEYS, zero)
        if self.state_loss_weight > 0:
            terms['state_loss'] = state_matching_loss(states, t['states'].to(states.dtype), self.state_norm)
        if need_t_attn:
            terms['attn_loss'] = cls_attention_loss(
                attn, t['attn'].to(attn.dtype), self.trainable_module_student().num_prefix_tokens,
                self.teacher_prefix_tokens)
        if self.kd_loss_weight > 0:
            terms['kd_loss'] = logit_kd_loss(logits, t['logits'].to(logits.dtype), self.kd_temperature)
        if self.jasmin_weight > 0:
            terms['jasmin_loss'] = jasmin_loss(attn, k=self.jasmin_k, detach=self.jasmin_detach)
        terms['task_loss'] = self.criterion(logits, target)
        # before the start epoch the label loss stays in the graph with weight 0: the head then receives a (zero)
        # gradient every step, which DDP requires of every trainable parameter
        task_weight = self.task_loss_weight if self.epoch >= self.task_loss_start_epoch else 0.
        guide = self.distill_scale()
        total = (guide * (self.state_loss_weight * terms['state_loss'] + self.attn_loss_weight * terms['attn_loss']
                          + self.kd_loss_weight * terms['kd_loss'] + self.jasmin_weight * terms['jasmin_loss'])
                 + task_weight * terms['task_loss'])
        return {'loss': total, 'output': logits, **terms}

    @torch.no_grad()
    def state_gaps(self, input: torch.Tensor, norm: Optional[Union[str, Sequence[str]]] = None) -> torch.Tensor:
        """Per target k, the distance (``norm``, default the task's ``state_norm``) between the student's state at
        time t_k and the teacher's block k output on a batch: the trajectory that the state loss sums, [K]. Several
        norms give one row each, [len(norm), K], from one teacher forward and one solve."""
        if self.target_times is None:
            self.calibrate(input)
        input_kd = self.teacher.normalize_input(input, self.student_mean, self.student_std)
        t = self._teacher_forward(input_kd, need_attn=False)
        _, states, _ = self.trainable_module(input, self.target_times.tolist(), return_attn=False)
        teacher_states = t['states'].to(states.dtype)
        single = norm is None or isinstance(norm, str)
        norms = [norm or self.state_norm] if single else list(norm)
        gaps = torch.stack([torch.stack([state_matching_loss(states[k:k + 1], teacher_states[k:k + 1], n)
                                         for k in range(states.shape[0])]) for n in norms])
        return gaps[0] if single else gaps

    def distill_scale(self) -> float:
        """The factor on the teacher's terms this epoch: 1, decaying linearly to 0 at ``distill_end_epoch``."""
        if self.distill_end_epoch is None:
            return 1.
        return max(0., 1. - self.epoch / self.distill_end_epoch)

    def trainable_module_student(self) -> DepthVisionTransformer:
        """The unwrapped student."""
        return unwrap_model(self.trainable_module).student
