"""Pretrained cfgs of the published weights (``weights/<arch>.<tag>/``), referenced from the models' default_cfgs,
and the one place the Hub organisation is named.

A tag is listed here only once its folder is committed under ``weights/`` (a test checks both directions).
"""
from typing import Any, Dict

from ..data import FASHION_MNIST_CLASSES, FASHION_MNIST_MEAN, FASHION_MNIST_STD

__all__ = ['ORG', 'hub_id', 'FMNIST_TAG', 'FMNIST_CFG', 'fmnist_cfg', 'keep_untagged_default']

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


def fmnist_cfg(arch: str, tag: str = FMNIST_TAG, img_size: int = 32) -> Dict[str, Any]:
    """depth_vit_cfg overrides for ``<arch>.<tag>``: where the weights live and what they expect (grey images at
    ``img_size``; a 224-px architecture trained at a smaller size names that size in its tag)."""
    return dict(FMNIST_CFG, hf_hub_id=hub_id(arch, tag), input_size=(1, img_size, img_size))


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
