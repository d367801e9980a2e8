"""Trajectory distillation: a discrete ViT teacher guides the depth trajectory of an ODE (or looped) student.

``TrajectoryDistillationTask`` is a ``timm.task.TrainingTask``; the tools' training command,
``python -m timm_odevit_tools.train --teacher ...``, trains with it.
"""
from .init import COPYABLE_PARTS, copy_from_teacher
from .losses import STATE_NORMS, cls_attention_loss, jasmin_loss, logit_kd_loss, state_matching_loss
from .task import LOSS_KEYS, TrajectoryDistillationTask, TrajectoryTrainableModule, attention_from_qkv, \
    find_attention_module
from .times import TIME_RULES, cls_distances, indices_to_times, paper_times, solver_grid, uniform_times, \
    validate_times

__all__ = [
    'STATE_NORMS',
    'TrajectoryDistillationTask', 'TrajectoryTrainableModule', 'LOSS_KEYS', 'copy_from_teacher', 'COPYABLE_PARTS',
    'state_matching_loss', 'cls_attention_loss', 'logit_kd_loss', 'jasmin_loss', 'find_attention_module',
    'attention_from_qkv', 'TIME_RULES', 'uniform_times', 'paper_times', 'cls_distances', 'solver_grid',
    'indices_to_times', 'validate_times',
]
