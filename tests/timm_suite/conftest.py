"""Pytest plugin that runs timm's own ``tests/test_models.py`` against our models only.

timm's test module picks models with ``list_models`` calls made at import time, and its ``NON_STD_FILTERS`` (ViT-like
models whose features are token sequences) and ``FEAT_INTER_FILTERS`` (modules with ``forward_intermediates``) do
not know our names. Before that module is imported, ``timm.list_models`` is wrapped so that (a) those two lists are
widened with our patterns and modules, in place, so later uses inside the module see them too, and (b) every
selection is narrowed to our models. Tests that cannot apply to our models are deselected in ``NOT_APPLICABLE``,
each with its reason; tests that never take one of our model names (timm-internal checks) are deselected too.
"""
import os
from pathlib import Path

import pytest
import timm

import timm_odevit  # noqa: F401  (registers the models)

# timm's per-test timeouts (120-360 s) are sized for its CI runners; the ODE-ViT paper configs (35 and 23 solver
# layers at width 768) need longer for the per-layer prune contract on 2 CPU cores. timm reads TIMEOUT at import.
os.environ.setdefault('TIMEOUT', '1500')

# an older set-up wrote the suite into this folder; test_timm_models.py runs it from the cache now
collect_ignore = ['test_models.py']

OUR_MODULES = ['odevit', 'ssog']
OUR_MODELS = set(timm.list_models(module=OUR_MODULES))
OUR_PATTERNS = ['odevit_*', 'ssog_vit_*', 'looped_ssog_*', 'ssog_ode_*', 'dense_vit_*', 'looped_vit_*']

# test function -> why it cannot apply to our models
NOT_APPLICABLE = {
    'test_model_forward_torchscript':
        'TorchScript cannot compile torchdiffeq solvers (ODE trunks) nor the shared integrator interface.',
    'test_model_forward_fx_torchscript': 'TorchScript, as above.',
    'test_model_forward_torchscript_with_features_fx': 'TorchScript, as above.',
    'test_model_inference': "needs timm's reference tensors on the Hub for models named 'test_*'.",
    'test_model_load_pretrained':
        'downloads from the real Hub (no network here); tests/test_hub.py loads every published weight through '
        'the local mirror instead.',
    'test_model_features_pretrained': 'downloads from the real Hub, as above.',
}

_orig_list_models = timm.list_models


def _is_ours(name: str) -> bool:
    return name.split('.')[0] in OUR_MODELS


def _list_models(filter='', module='', *args, **kwargs):
    if isinstance(filter, list) and 'vit_*' in filter and 'deit*' in filter:  # NON_STD_FILTERS itself
        filter.extend(p for p in OUR_PATTERNS if p not in filter)
    if isinstance(module, list) and 'vision_transformer' in module:  # FEAT_INTER_FILTERS
        module.extend(m for m in OUR_MODULES if m not in module)
    exclude = kwargs.get('exclude_filters')
    if isinstance(exclude, list) and 'vit_*' in exclude and 'deit*' in exclude:  # ... + NON_STD_FILTERS
        kwargs['exclude_filters'] = exclude + OUR_PATTERNS
    return [n for n in _orig_list_models(filter, module, *args, **kwargs) if _is_ours(n)]


timm.list_models = _list_models
timm.models.list_models = _list_models


def pytest_collection_modifyitems(config, items):
    # conftest hooks see the whole session: leave our own tests outside this folder alone
    here = Path(__file__).parent
    keep, drop = [], []
    for item in items:
        if here not in Path(item.fspath).parents:
            keep.append(item)
            continue
        name = getattr(item, 'originalname', item.name)
        params = getattr(getattr(item, 'callspec', None), 'params', {})
        model = params.get('model_name')
        if name in NOT_APPLICABLE or not (isinstance(model, str) and _is_ours(model)):
            drop.append(item)
        else:
            item.add_marker(pytest.mark.timm_suite)
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
