"""Plug-and-play initialisation: a student starts from its teacher's stem and head (ODE-ViT's recipe).

Everything is copied into the student's own Parameters: ODE-ViT's released code made the student's position
embedding the teacher's Parameter object, so training the student moved the teacher's targets.
"""
from typing import List, Sequence

import torch
from torch import nn
from timm.layers import resample_abs_pos_embed, resample_patch_embed
from timm.utils import unwrap_model

__all__ = ['COPYABLE_PARTS', 'copy_from_teacher']

COPYABLE_PARTS = ('patch_embed', 'cls_token', 'pos_embed', 'head')


def _patch_embed(student: nn.Module, teacher: nn.Module) -> List[nn.Parameter]:
    s_proj, t_proj = student.patch_embed.proj, teacher.patch_embed.proj
    weight = t_proj.weight
    if weight.shape[:2] != s_proj.weight.shape[:2]:
        raise ValueError(
            f'Cannot copy the patch embedding: teacher maps {weight.shape[1]} channels to width {weight.shape[0]}, '
            f'the student {s_proj.weight.shape[1]} to {s_proj.weight.shape[0]}. Use the same in_chans and width, '
            "or leave 'patch_embed' out of the copied parts.")
    if weight.shape[2:] != s_proj.weight.shape[2:]:
        # another patch size: timm's pseudo-inverse resampling keeps the embedding of resized patches
        weight = resample_patch_embed(weight, list(s_proj.weight.shape[2:]))
    s_proj.weight.copy_(weight)
    copied = [s_proj.weight]
    if s_proj.bias is not None:
        # the released code froze this bias without copying it; a teacher without one means a zero bias
        s_proj.bias.copy_(t_proj.bias if t_proj.bias is not None else torch.zeros_like(s_proj.bias))
        copied.append(s_proj.bias)
    return copied


def _cls_token(student: nn.Module, teacher: nn.Module) -> List[nn.Parameter]:
    t_cls = getattr(teacher, 'cls_token', None)
    if student.cls_token is None or t_cls is None:
        raise ValueError("Cannot copy the CLS token: both models need one (or leave 'cls_token' out).")
    if t_cls.shape != student.cls_token.shape:
        raise ValueError(f'CLS token shapes differ: teacher {tuple(t_cls.shape)}, student '
                         f'{tuple(student.cls_token.shape)}.')
    student.cls_token.copy_(t_cls)
    return [student.cls_token]


def _pos_embed(student: nn.Module, teacher: nn.Module) -> List[nn.Parameter]:
    t_pos = getattr(teacher, 'pos_embed', None)
    if t_pos is None or t_pos.shape[-1] != student.pos_embed.shape[-1]:
        raise ValueError("Cannot copy the position embedding: the teacher has none of the student's width (or leave "
                         "'pos_embed' out).")
    t_grid = tuple(teacher.patch_embed.grid_size)
    # prefix positions the teacher embeds (CLS, and in timm registers too, unless no_embed_class)
    t_prefix = t_pos.shape[1] - t_grid[0] * t_grid[1]
    s_prefix = int(student.has_class_token)
    patches = resample_abs_pos_embed(
        t_pos[:, t_prefix:], new_size=student.patch_embed.grid_size, old_size=t_grid, num_prefix_tokens=0)
    student.pos_embed[:, s_prefix:].copy_(patches)
    if s_prefix:
        has_cls_pos = t_prefix >= 1 and getattr(teacher, 'cls_token', None) is not None
        student.pos_embed[:, :1].copy_(t_pos[:, :1] if has_cls_pos else torch.zeros_like(t_pos[:, :1]))
    return [student.pos_embed]


def _head(student: nn.Module, teacher: nn.Module) -> List[nn.Parameter]:
    t_head, s_head = teacher.get_classifier(), student.get_classifier()
    if not isinstance(t_head, nn.Linear) or not isinstance(s_head, nn.Linear) or t_head.weight.shape != \
            s_head.weight.shape:
        raise ValueError(
            f'Cannot copy the head: teacher {t_head}, student {s_head}. Both must be Linear with the same '
            "classes and width (or leave 'head' out).")
    s_head.weight.copy_(t_head.weight)
    copied = [s_head.weight]
    if s_head.bias is not None:
        s_head.bias.copy_(t_head.bias if t_head.bias is not None else torch.zeros_like(s_head.bias))
        copied.append(s_head.bias)
    return copied


_COPIERS = {'patch_embed': _patch_embed, 'cls_token': _cls_token, 'pos_embed': _pos_embed, 'head': _head}


@torch.no_grad()
def copy_from_teacher(
        student: nn.Module,
        teacher: nn.Module,
        parts: Sequence[str] = COPYABLE_PARTS,
        freeze: bool = False,
) -> List[str]:
    """Copy the teacher's patch embedding (weight and bias), CLS token, position embedding (resampled to the
    student's grid) and head into the student's own Parameters; optionally freeze them. Returns the names set."""
    student, teacher = unwrap_model(student), unwrap_model(teacher)
    unknown = set(parts) - set(COPYABLE_PARTS)
    if unknown:
        raise ValueError(f'Unknown parts {sorted(unknown)}; choose from {COPYABLE_PARTS}.')
    copied = []
    for part in parts:
        copied.extend(_COPIERS[part](student, teacher))
    names = {id(p): n for n, p in student.named_parameters()}
    for p in copied:
        if freeze:
            p.requires_grad_(False)
    return [names[id(p)] for p in copied]
