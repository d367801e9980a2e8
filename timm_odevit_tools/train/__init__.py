"""The one training command, ``python -m timm_odevit_tools.train``: a model alone or, with ``--teacher``, a student
guided by a teacher's trajectory; and the one loader of the models its checkpoints hold."""
from .checkpoint import checkpoint_args, model_from_checkpoint, read_checkpoint
from .command import (PROG, build_task, format_command, is_training_command, main, parse_args, read_summary,
                      recorded_args)

__all__ = ['PROG', 'build_task', 'checkpoint_args', 'format_command', 'is_training_command', 'main',
           'model_from_checkpoint', 'parse_args', 'read_checkpoint', 'read_summary', 'recorded_args']
