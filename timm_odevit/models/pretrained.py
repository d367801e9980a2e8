"""Pretrained cfgs of the published weights (``weights/<arch>.<tag>/``), referenced from the models' default_cfgs,
and the one place the Hub organisation is named.

A tag is listed here only once its folder is committed under ``weights/`` (a test checks both directions).
"""
import os
from typing import Any, Dict, Optional

from ..data import FASHION_MNIST_CLASSES, FASHION_MNIST_MEAN, FASHION_MNIST_STD

__all__ = ['ORG', 'hub_id', 'FMNIST_TAG', 'FMNIST_CFG', 'fmnist_input', 'fmnist_cfg', 'TAG_MODEL_ARGS',
           'tag_model_args', 'keep_untagged_default', 'check_reachable']

# the one place the Hub organisation is named; every published hf_hub_id is built from it by hub_id()
ORG = 'timm-odevit'


def hub_id(arch: str, tag: str) -> str:
    """``'<ORG>/<arch>.<tag>'``: the Hub repository of one published weight."""
    return f'{ORG}/{arch}.{tag}'


FMNIST_TAG = 'fmnist'
# the Fashion-MNIST weights take 1 grey channel at 32 px, normalised with the training set's mean and std
FMNIST_CFG: Dict[str, Any] = dict(
    num_classes=10, input_size=(1, 32, 32), crop_pct=1.0, interpolation='bicubic',
    mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD, label_names=list(FASHION_MNIST_CLASSES),
)


def fmnist_input(img_size: Optional[int] = None) -> Dict[str, Any]:
    """FMNIST_CFG at another input size: what weights trained with ``--model-kwargs img_size=<n>`` expect (None:
    FMNIST_CFG's own 32 px)."""
    chans, height, _ = FMNIST_CFG['input_size']
    size = height if img_size is None else img_size
    return dict(FMNIST_CFG, input_size=(chans, size, size))


def fmnist_cfg(arch: str, tag: str = FMNIST_TAG, img_size: Optional[int] = None) -> Dict[str, Any]:
    """depth_vit_cfg overrides for ``<arch>.<tag>``: where the weights live and what they expect (grey images at
    ``img_size``, by default FMNIST_CFG's; a 224-px architecture trained at a smaller size names that size in its
    tag)."""
    return dict(fmnist_input(img_size), hf_hub_id=hub_id(arch, tag))


# Model kwargs a published weight was trained with beyond its architecture's defaults: the ODE weights trained on
# ODE-ViT's 23-step grid score 0.6-6 points lower on the architecture's 12 steps, so their tag solves on the grid they
# learnt. Each folder's config.json carries the same ``model_args`` (a test checks both directions), which timm's
# hf-hub: and local-dir: routes apply as defaults; create_depth_vit applies these to a tag asked for by name.
TAG_MODEL_ARGS: Dict[str, Dict[str, Any]] = {
    'odevit_tiny_patch4_32.fmnist': dict(ode_steps=23),
    'odevit_tiny_patch4_32.fmnist_distilled': dict(ode_steps=23),
    'ssog_ode_tiny_patch4_32.fmnist': dict(ode_steps=23),
    'ssog_ode_tiny_patch4_32.fmnist_distilled': dict(ode_steps=23),
}


def tag_model_args(variant: str, tag: Optional[str]) -> Dict[str, Any]:
    """The model kwargs ``<variant>.<tag>`` was trained with beyond the architecture's defaults (empty when none)."""
    return dict(TAG_MODEL_ARGS.get(f'{variant}.{tag}', {})) if tag else {}


def keep_untagged_default(default_cfgs: Dict[str, Any]) -> Dict[str, Any]:
    """Make the untagged cfg the default again for archs that gained a published tag.

    timm's generate_default_cfgs promotes the first tag with weights to the default, which would silently turn
    ``create_model('ssog_ode_tiny_patch4_32')`` into a 1-channel, 10-class model; our defaults stay 3-channel,
    1000-class, and the weights are asked for by name (``'<arch>.fmnist'``).
    """
    for dc in default_cfgs.values():
        if '' in dc.tags and dc.tags[0] != '':
            dc.tags.remove('')
            dc.tags.appendleft('')
    return default_cfgs


def check_reachable(hf_hub_id: Optional[str], file: Optional[str] = None) -> None:
    """Fail at once, saying what to do, when ``pretrained=True`` would ask huggingface.co for weights of ours.

    Our weights are not on huggingface.co yet, so without a mirror (``HF_ENDPOINT``) or a cached copy the Hub client
    would retry for most of a minute and end with "check your connection". A local file, another organisation's
    repository, a mirror or a copy in the Hub cache pass through untouched.
    """
    if not hf_hub_id or not hf_hub_id.startswith(f'{ORG}/') or file:
        return
    from huggingface_hub import constants, try_to_load_from_cache
    mirrored = os.environ.get('HF_ENDPOINT') or constants.ENDPOINT.rstrip('/') != 'https://huggingface.co'
    if mirrored or isinstance(try_to_load_from_cache(hf_hub_id, 'model.safetensors'), str):
        return
    repo = hf_hub_id.split('/', 1)[1]
    raise RuntimeError(
        f'{hf_hub_id} is not on huggingface.co yet, and no local Hub mirror is set. Serve the published weights with '
        f'`python -m timm_odevit.hub serve --root weights` and set HF_ENDPOINT to the address it prints before Python '
        f"starts, or load the folder directly: timm.create_model('local-dir:weights/{repo}', pretrained=True).")
