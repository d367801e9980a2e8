"""SSoG families (separable sum-of-Gaussians token mixer) in discrete, looped and continuous depth, the steered
discrete variant, and the dense attention twins of the discrete and looped models. Each SSoG model and its twin
differ only in the token mixer; the continuous model's dense twin is ``odevit_*`` (see odevit.py).
"""
from typing import Any

from timm.models import generate_default_cfgs, register_model

from .pretrained import fmnist_cfg, keep_untagged_default
from .trunk import SMALL_IMAGE_ARGS, SMALL_IMAGE_CFG, WIDTHS, DepthVisionTransformer, create_depth_vit, depth_vit_cfg

# '<arch>.<tag>': published Fashion-MNIST weights (weights/<arch>.<tag>/, models/pretrained.py); the untagged
# cfg stays the default (keep_untagged_default), so plain names keep 3 channels and 1000 classes, and
# pretrained=True without a tag loads the first published one (create_depth_vit)
default_cfgs = keep_untagged_default(generate_default_cfgs({
    'ssog_vit_tiny': depth_vit_cfg(),
    'ssog_vit_tiny_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_vit_tiny_patch4_32.fmnist': depth_vit_cfg(**dict(SMALL_IMAGE_CFG, **fmnist_cfg('ssog_vit_tiny_patch4_32'))),
    'ssog_vit_small': depth_vit_cfg(),
    'ssog_vit_small_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_vit_base': depth_vit_cfg(),
    'ssog_vit_base_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_vit_steer_tiny': depth_vit_cfg(),
    'ssog_vit_steer_tiny_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_vit_steer_small': depth_vit_cfg(),
    'ssog_vit_steer_small_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_vit_steer_base': depth_vit_cfg(),
    'ssog_vit_steer_base_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'looped_ssog_tiny': depth_vit_cfg(),
    'looped_ssog_tiny_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'looped_ssog_tiny_patch4_32.fmnist':
        depth_vit_cfg(**dict(SMALL_IMAGE_CFG, **fmnist_cfg('looped_ssog_tiny_patch4_32'))),
    'looped_ssog_small': depth_vit_cfg(),
    'looped_ssog_small_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'looped_ssog_base': depth_vit_cfg(),
    'looped_ssog_base_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_ode_tiny': depth_vit_cfg(),
    'ssog_ode_tiny_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_ode_tiny_patch4_32.fmnist': depth_vit_cfg(**dict(SMALL_IMAGE_CFG, **fmnist_cfg('ssog_ode_tiny_patch4_32'))),
    'ssog_ode_tiny_patch4_32.fmnist_distilled': depth_vit_cfg(
        **dict(SMALL_IMAGE_CFG, **fmnist_cfg('ssog_ode_tiny_patch4_32', 'fmnist_distilled'))),
    'ssog_ode_small': depth_vit_cfg(),
    # trained on a CPU at 64 px (patch 16 -> a 4x4 grid), the size that budget allowed; the tag says so
    'ssog_ode_small.fmnist_64px': depth_vit_cfg(**fmnist_cfg('ssog_ode_small', 'fmnist_64px', img_size=64)),
    'ssog_ode_small_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'ssog_ode_base': depth_vit_cfg(),
    'ssog_ode_base_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'dense_vit_tiny': depth_vit_cfg(),
    'dense_vit_tiny_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'dense_vit_tiny_patch4_32.fmnist': depth_vit_cfg(**dict(SMALL_IMAGE_CFG, **fmnist_cfg('dense_vit_tiny_patch4_32'))),
    'dense_vit_small': depth_vit_cfg(),
    'dense_vit_small_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'dense_vit_base': depth_vit_cfg(),
    'dense_vit_base_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'looped_vit_tiny': depth_vit_cfg(),
    'looped_vit_tiny_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'looped_vit_tiny_patch4_32.fmnist':
        depth_vit_cfg(**dict(SMALL_IMAGE_CFG, **fmnist_cfg('looped_vit_tiny_patch4_32'))),
    'looped_vit_small': depth_vit_cfg(),
    'looped_vit_small_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
    'looped_vit_base': depth_vit_cfg(),
    'looped_vit_base_patch4_32': depth_vit_cfg(**SMALL_IMAGE_CFG),
}))


@register_model
def ssog_vit_tiny(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', **WIDTHS['tiny'])
    return create_depth_vit('ssog_vit_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', **WIDTHS['tiny'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_vit_tiny_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_small(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', **WIDTHS['small'])
    return create_depth_vit('ssog_vit_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', **WIDTHS['small'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_vit_small_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_base(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', **WIDTHS['base'])
    return create_depth_vit('ssog_vit_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_base_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', **WIDTHS['base'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_vit_base_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_steer_tiny(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', ssog_steer=True, **WIDTHS['tiny'])
    return create_depth_vit('ssog_vit_steer_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_steer_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', ssog_steer=True, **WIDTHS['tiny'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_vit_steer_tiny_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_steer_small(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', ssog_steer=True, **WIDTHS['small'])
    return create_depth_vit('ssog_vit_steer_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_steer_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', ssog_steer=True, **WIDTHS['small'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_vit_steer_small_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_steer_base(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', ssog_steer=True, **WIDTHS['base'])
    return create_depth_vit('ssog_vit_steer_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_vit_steer_base_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='discrete', ssog_steer=True, **WIDTHS['base'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_vit_steer_base_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_ssog_tiny(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='looped', **WIDTHS['tiny'])
    return create_depth_vit('looped_ssog_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_ssog_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='looped', **WIDTHS['tiny'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('looped_ssog_tiny_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_ssog_small(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='looped', **WIDTHS['small'])
    return create_depth_vit('looped_ssog_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_ssog_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='looped', **WIDTHS['small'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('looped_ssog_small_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_ssog_base(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='looped', **WIDTHS['base'])
    return create_depth_vit('looped_ssog_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_ssog_base_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='looped', **WIDTHS['base'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('looped_ssog_base_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_ode_tiny(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='ode', **WIDTHS['tiny'])
    return create_depth_vit('ssog_ode_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_ode_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='ode', **WIDTHS['tiny'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_ode_tiny_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_ode_small(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='ode', **WIDTHS['small'])
    return create_depth_vit('ssog_ode_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_ode_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='ode', **WIDTHS['small'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_ode_small_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_ode_base(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='ode', **WIDTHS['base'])
    return create_depth_vit('ssog_ode_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ssog_ode_base_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='ssog', depth_mode='ode', **WIDTHS['base'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('ssog_ode_base_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def dense_vit_tiny(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='discrete', **WIDTHS['tiny'])
    return create_depth_vit('dense_vit_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def dense_vit_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='discrete', **WIDTHS['tiny'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('dense_vit_tiny_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def dense_vit_small(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='discrete', **WIDTHS['small'])
    return create_depth_vit('dense_vit_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def dense_vit_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='discrete', **WIDTHS['small'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('dense_vit_small_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def dense_vit_base(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='discrete', **WIDTHS['base'])
    return create_depth_vit('dense_vit_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def dense_vit_base_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='discrete', **WIDTHS['base'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('dense_vit_base_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_vit_tiny(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='looped', **WIDTHS['tiny'])
    return create_depth_vit('looped_vit_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_vit_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='looped', **WIDTHS['tiny'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('looped_vit_tiny_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_vit_small(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='looped', **WIDTHS['small'])
    return create_depth_vit('looped_vit_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_vit_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='looped', **WIDTHS['small'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('looped_vit_small_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_vit_base(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='looped', **WIDTHS['base'])
    return create_depth_vit('looped_vit_base', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def looped_vit_base_patch4_32(pretrained: bool = False, **kwargs: Any) -> DepthVisionTransformer:
    model_args = dict(mixer='attention', depth_mode='looped', **WIDTHS['base'], **SMALL_IMAGE_ARGS)
    return create_depth_vit('looped_vit_base_patch4_32', pretrained=pretrained, **dict(model_args, **kwargs))
