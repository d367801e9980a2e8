"""ODE-ViT (arXiv 2511.16501): a ViT as a well-posed ODE, dx/dt = A(CN(x)) + M(CN(x)), solved with torchdiffeq.

``odevit_{tiny,small,base}`` are the dense twins of ``ssog_ode_*``; ``odevit_w768_mlp1_36pt`` and
``odevit_w768_mlp4_24pt`` are the paper's two teacher-student configurations.
"""
from typing import Any

from timm.models import generate_default_cfgs, register_model

from .pretrained import fmnist_cfg, keep_untagged_default
from .trunk import SMALL_IMAGE_ARGS, SMALL_IMAGE_CFG, WIDTHS, DepthVisionTransformer, create_depth_vit, depth_vit_cfg

# the paper's configs: width 768, 12 heads, no biases, 10 registers, no final norm, Euler on [0, 12] (the paper's
# [0, 1] with the field scaled by 12); every solver point is a layer, so teacher blocks map to grid indices
PAPER_ARGS = dict(embed_dim=768, num_heads=12, mixer='attention', depth_mode='ode', reg_tokens=10, final_norm=False,
                  ode_t_end=12.)

# '<arch>.fmnist': published Fashion-MNIST weights (weights/<arch>.fmnist/, models/pretrained.py); the untagged
# cfg stays the default (keep_untagged_default), so plain names keep 3 channels and 1000 classes
default_cfgs = keep_untagged_default(generate_default_cfgs({
    'odevit_tiny': depth_vit_cfg(),
    'odevit_tiny_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'odevit_tiny_patch4_32.fmnist': depth_vit_cfg(**dict(SMALL_IMAGE_CFG, **fmnist_cfg('odevit_tiny_patch4_32'))),
    'odevit_tiny_patch4_32.fmnist_distilled': depth_vit_cfg(
        **dict(SMALL_IMAGE_CFG, **fmnist_cfg('odevit_tiny_patch4_32', 'fmnist_distilled'))),
    'odevit_small': depth_vit_cfg(),
    'odevit_small_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'odevit_base': depth_vit_cfg(),
    'odevit_base_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'odevit_w768_mlp1_36pt': depth_vit_cfg(),
    'odevit_w768_mlp4_24pt': depth_vit_cfg(),
}))


@register_model
def odevit_tiny(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='ode', **WIDTHS['tiny'])
    return create_depth_vit('odevit_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def odevit_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='ode', **WIDTHS['tiny'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('odevit_tiny_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def odevit_small(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='ode', **WIDTHS['small'])
    return create_depth_vit('odevit_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def odevit_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='ode', **WIDTHS['small'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('odevit_small_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def odevit_base(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='ode', **WIDTHS['base'])
    return create_depth_vit('odevit_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def odevit_base_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='ode', **WIDTHS['base'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('odevit_base_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def odevit_w768_mlp1_36pt(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(PAPER_ARGS, mlp_ratio=1., depth=35, ode_steps=35)
    return create_depth_vit('odevit_w768_mlp1_36pt', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def odevit_w768_mlp4_24pt(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(PAPER_ARGS, mlp_ratio=4., depth=23, ode_steps=23)
    return create_depth_vit('odevit_w768_mlp4_24pt', pretrained=pretrained, **dict(model_args, **kwargs))
