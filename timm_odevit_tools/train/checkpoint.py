"""Checkpoints of the training command: read one safely, and rebuild the model it holds.

``model_from_checkpoint`` is the one checkpoint-to-model loader: it takes this command's checkpoints (timm's
``CheckpointSaver`` format, which timm's train.py writes too) and the older single-file recipe checkpoints
(``{'arch', 'state_dict', 'pretrained_cfg'}``). The weights go through timm's ``load_state_dict``, whose
``clean_state_dict`` strips DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes.
"""
import argparse
import pickle
import zipfile
from typing import Any, Dict, Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

import timm
from timm.models import load_state_dict

__all__ = ['read_checkpoint', 'unreadable', 'checkpoint_args', 'model_from_checkpoint']


def read_checkpoint(path: str) -> Dict[str, Any]:
    """A checkpoint as a dict, unpickled with ``weights_only=True``: tensors, plain containers and the
    ``argparse.Namespace`` of the command line that CheckpointSaver stores (nothing else can execute on load)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location='cpu', weights_only=True)


def unreadable(path: str) -> Optional[str]:
    """Why a weights or checkpoint file cannot be loaded (truncated, corrupt, not a checkpoint), or None; reads the
    safetensors header, or checks every member's CRC of torch's zip format, without unpickling anything."""
    try:
        if path.endswith('.safetensors'):
            with safe_open(path, 'pt') as f:
                f.keys()
            return None
        if not zipfile.is_zipfile(path):
            read_checkpoint(path)  # torch's legacy format (not a zip): loading it is the only check
            return None
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        return None if bad is None else f'member {bad} fails its CRC check'
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile,
            SafetensorError) as e:
        return f'{type(e).__name__}: {e}'


def checkpoint_args(ckpt: Dict[str, Any]) -> Dict[str, Any]:
    """The command-line options a checkpoint was trained with (empty for a checkpoint without them)."""
    args = ckpt.get('args')
    return dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args or {})


def model_from_checkpoint(
        path: str,
        arch: Optional[str] = None,
        use_ema: bool = False,
        pretrained_cfg: Optional[Dict[str, Any]] = None,
        **model_kwargs: Any,
) -> nn.Module:
    """The model a checkpoint holds, in eval mode, built as the registered architecture.

    Args:
        path: A checkpoint of ``python -m timm_odevit_tools.train`` (or timm's train.py, or an older recipe file).
        arch: Architecture (default: the one the checkpoint names).
        use_ema: Take the EMA weights where the checkpoint has them.
        pretrained_cfg: Preprocessing to record on the model (default: the checkpoint's own, if it has one); its
            ``input_size`` sets ``img_size``.
        **model_kwargs: Further constructor kwargs. The training run's ``--model-kwargs`` are not applied, so that
            the model is what ``config.json`` describes (e.g. an ODE model gets its registered solver).

    ``num_classes`` and ``in_chans`` come from the head and patch-embedding shapes.
    """
    import timm_odevit  # noqa: F401  (registers the architectures a checkpoint names)
    ckpt = read_checkpoint(path)
    arch = arch or checkpoint_args(ckpt).get('model') or ckpt.get('arch')
    if not arch:
        raise ValueError(f'{path} does not name its architecture; pass arch.')
    if not timm.is_model(arch):
        raise ValueError(f"{arch!r} is not a registered timm model: pass a registered name as arch (hub export: "
                         "--arch); timm.list_models('*ode*') lists this package's ODE models.")
    with torch.serialization.safe_globals([argparse.Namespace]):
        state_dict = load_state_dict(path, use_ema=use_ema)
    cfg = pretrained_cfg if pretrained_cfg is not None else ckpt.get('pretrained_cfg') or {}
    if 'head.weight' in state_dict:
        model_kwargs.setdefault('num_classes', state_dict['head.weight'].shape[0])
    if 'patch_embed.proj.weight' in state_dict:
        model_kwargs.setdefault('in_chans', state_dict['patch_embed.proj.weight'].shape[1])
    if 'input_size' in cfg:
        model_kwargs.setdefault('img_size', cfg['input_size'][-1])
    model = timm.create_model(arch, pretrained=False, **model_kwargs)
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:
        trained = checkpoint_args(ckpt).get('model_kwargs') or {}
        detail = '; '.join(line.strip() for line in str(e).splitlines()[1:3])  # the first line names the class only
        raise ValueError(f'{path} does not fit {arch} built with {model_kwargs}'
                         + (f'; it was trained with --model-kwargs {trained}: pass those that change the architecture '
                            'as keyword arguments of model_from_checkpoint' if trained else
                            ': pass the architecture it was trained as (hub export: --arch)') + f'. ({detail})') from e
    model.pretrained_cfg = dict(model.pretrained_cfg, **cfg)
    return model.eval()
