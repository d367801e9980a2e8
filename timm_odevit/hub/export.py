"""Export a trained checkpoint into ``weights/<arch>.<tag>/`` exactly as its Hub repository, and push one.

The folder holds ``model.safetensors`` and ``config.json`` as ``timm.models.save_for_hf`` writes them, and a model
card ``README.md`` rendered by timm's ``generate_readme``; ``weights/MANIFEST.json`` is rewritten with every file's
sha256 and size, and the repo is verified (config, architecture, weight shapes) before the command returns.
"""
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

import timm
from timm.models import save_for_hf
from timm.models._hub import generate_readme

from . import CARD_FILE, CONFIG_FILE, ORG, WEIGHTS_FILE, hub_id
from .recipe import AUGMENT_SHIFT, recipe_command
from .verify import verify_repo, write_manifest

__all__ = ['model_from_checkpoint', 'model_card', 'export', 'push']

DATASET = 'Fashion-MNIST'


def _state_dict(ckpt: Dict[str, Any], use_ema: bool) -> Dict[str, torch.Tensor]:
    for key in (('state_dict_ema', 'state_dict') if use_ema else ('state_dict', 'model')):
        if key in ckpt and isinstance(ckpt[key], dict):
            return ckpt[key]
    return ckpt


def model_from_checkpoint(
        checkpoint: str,
        arch: Optional[str] = None,
        use_ema: bool = False,
        pretrained_cfg: Optional[Dict[str, Any]] = None,
) -> nn.Module:
    """Rebuild the model a checkpoint holds: ours (``recipe.train_to_checkpoint``) or timm train.py's.

    ``num_classes`` and ``in_chans`` come from the head and patch-embedding shapes; ``pretrained_cfg`` (or the
    checkpoint's own) sets the preprocessing the exported config.json records.
    """
    ckpt = torch.load(checkpoint, map_location='cpu', weights_only=True)
    arch = arch or ckpt.get('arch')
    if not arch:
        raise ValueError(f'{checkpoint} does not name its architecture; pass --arch.')
    if not timm.is_model(arch):
        raise ValueError(f'{arch!r} is not a registered timm model (did you import timm_odevit?).')
    sd = {k[len('module.'):] if k.startswith('module.') else k: v for k, v in _state_dict(ckpt, use_ema).items()}
    kwargs = {}
    if 'head.weight' in sd:
        kwargs['num_classes'] = sd['head.weight'].shape[0]
    if 'patch_embed.proj.weight' in sd:
        kwargs['in_chans'] = sd['patch_embed.proj.weight'].shape[1]
    model = timm.create_model(arch, pretrained=False, **kwargs)
    model.load_state_dict(sd, strict=True)
    cfg = pretrained_cfg if pretrained_cfg is not None else ckpt.get('pretrained_cfg', {})
    model.pretrained_cfg = dict(model.pretrained_cfg, **cfg)
    model.eval()
    return model


def _recipe_lines(arch: str, recipe: Dict[str, Any], cfg: Dict[str, Any]) -> Dict[str, str]:
    """One run of ``hub.recipe`` as card lines: data, schedule, the command that reruns it."""
    size = cfg['input_size']
    init = recipe.get('init_checkpoint')
    # stages recorded before the augment / bf16 options existed ran without them
    augment, bf16, threads = recipe.get('augment', False), recipe.get('bf16', False), recipe['threads']
    return {
        'data': f'{recipe["n_train"]} training images (first n of a permutation seeded {recipe["seed"]}), '
                f'resized 28 -> {size[-1]} px bicubic, normalised mean {cfg["mean"]} / std {cfg["std"]}, '
                + (f'random horizontal flip and shift of up to {AUGMENT_SHIFT} px' if augment
                   else 'no augmentation'),
        'schedule': f'{recipe["epochs"]} epochs, batch {recipe["batch_size"]}, AdamW lr {recipe["lr"]} '
                    f'weight decay {recipe["weight_decay"]}, warm-up {recipe["warmup_frac"]:.0%} then cosine, '
                    f'grad clip {recipe["clip_grad"]}, {"bf16 autocast" if bf16 else "fp32"}, '
                    f'CPU ({threads} thread{"s" if threads > 1 else ""})'
                    + (', starting from the previous stage\'s weights' if init else ''),
        'command': f'`{recipe_command(arch, recipe)}`',
    }


def model_card(
        arch: str,
        tag: str,
        model: nn.Module,
        metrics: Dict[str, Any],
        recipe: Optional[Dict[str, Any]] = None,
        description: Optional[str] = None,
) -> Dict[str, Any]:
    """The card as timm's generate_readme takes it (what, data, recipe, top-1 with its command, size, usage).

    ``recipe`` is our CPU recipe's dict (``hub.recipe.Recipe``; with ``'stages'``, every run of a chain that
    continued from the one before), or a dict of already rendered lines.
    """
    from ..benchmark.runner import count_gmacs
    size = model.pretrained_cfg['input_size']
    params = sum(p.numel() for p in model.parameters())
    rid = hub_id(arch, tag)
    details: Dict[str, Any] = {
        'Model Type': 'Image classification',
        'Architecture': f'`{arch}` from timm_odevit (registered in timm on `import timm_odevit`)',
        'Params (M)': f'{params / 1e6:.3f}',
        'GMACs': f'{count_gmacs(model, size[-1]):.4f}',
        'Image size': f'{size[-1]} x {size[-2]}, {size[0]} channel(s)',
        'Dataset': DATASET,
        'License': 'apache-2.0',
    }
    if recipe and 'n_train' not in recipe:
        details['Training recipe'] = dict(recipe)  # already rendered (the study's runs)
    elif recipe:
        stages = recipe.get('stages') or [recipe]
        lines: Dict[str, str] = {}
        for i, stage in enumerate(stages):
            prefix = f'stage {i + 1} of {len(stages)}, ' if len(stages) > 1 else ''
            lines.update({prefix + k: v for k, v in _recipe_lines(arch, stage, model.pretrained_cfg).items()})
        details['Training recipe'] = lines
    results = {}
    for name, m in metrics.items():
        results[name] = (f'top-1 {m["top1"]:.2f}% ({m["correct"]}/{m["n"]}), reproduce with '
                         f'`{m["command"]}`')
    details['Measured'] = results
    usage = (
        '```python\nimport timm, timm_odevit, torch\n\n'
        f"model = timm.create_model('{arch}.{tag}', pretrained=True).eval()   # or 'hf-hub:{rid}'\n"
        "cfg = timm.data.resolve_data_config(model=model)\n"
        "transform = timm.data.create_transform(**cfg)                  "
        f"# grey PIL image in, {size[0]}x{size[1]}x{size[2]} out\n"
        "# timm's validate.py: python -m timm_odevit.run validate.py --dataset torch/fashion_mnist \\\n"
        f"#   --data-dir DATA --split test --model {arch}.{tag} --pretrained --in-chans 1\n```\n")
    return {
        'tags': ['image-classification', 'timm', 'timm_odevit'],
        'license': 'apache-2.0',
        'description': description or (
            f'`{arch}` trained from scratch on {DATASET} (28x28 grey clothing images, 10 classes, resized to '
            f'{size[-1]} px) on a CPU; the training recipe and the measured top-1 are below.'),
        'details': details,
        'usage': usage,
    }


def export(
        model: nn.Module,
        arch: str,
        tag: str,
        root: str = 'weights',
        card: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write ``root/<arch>.<tag>/`` (safetensors, config.json, README.md), update the manifest and verify it."""
    repo = Path(root) / f'{arch}.{tag}'
    save_for_hf(model, str(repo), safe_serialization=True)
    (repo / CARD_FILE).write_text(generate_readme(card or {}, f'{arch}.{tag}'), encoding='utf-8')
    write_manifest(Path(root))
    errors = verify_repo(Path(root), repo.name)
    if errors:
        raise errors[0]
    return repo


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def push(folder: str, repo_id: Optional[str] = None, dry_run: bool = False, token: Optional[str] = None,
         private: bool = False) -> List[str]:
    """Push ``weights/<arch>.<tag>/`` with timm's ``push_to_hf_hub``, then the folder's own model card.

    The model is rebuilt from the folder (``local-dir:``) so that timm re-serialises exactly what is there; the dry
    run does that serialisation into a temporary folder and reports each file, its size and whether it is
    byte-identical to the folder's, without touching the network.
    """
    folder_p = Path(folder)
    repo_id = repo_id or f'{ORG}/{folder_p.name}'
    model = timm.create_model(f'local-dir:{folder_p.resolve()}', pretrained=True)
    lines = [f'repo: {repo_id} (private={private})']
    if dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            save_for_hf(model, tmp, safe_serialization=True)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                sent = Path(tmp) / name
                mine = folder_p / name
                if not mine.is_file():
                    same = 'not in'
                elif _sha(sent) == _sha(mine):
                    same = 'byte-identical to'
                elif name == CONFIG_FILE and json.loads(sent.read_text()) == json.loads(mine.read_text()):
                    same = 'same JSON (key order aside) as'  # timm's dict order after a local-dir round trip
                else:
                    same = 'DIFFERS from'
                lines.append(f'  {name:18s} {sent.stat().st_size:>10d} bytes  sha256 {_sha(sent)[:16]}  '
                             f'{same} {mine}')
        card = folder_p / CARD_FILE
        lines.append(f'  {CARD_FILE:18s} {card.stat().st_size:>10d} bytes  (uploaded after, replacing any '
                     'generated card)')
        lines.append('dry run: nothing sent')
        return lines
    from huggingface_hub import HfApi
    from timm.models import push_to_hf_hub
    push_to_hf_hub(model, repo_id, token=token, private=private, safe_serialization=True,
                   commit_message=f'Add {folder_p.name} weights (timm_odevit)')
    HfApi(token=token).upload_file(path_or_fileobj=str(folder_p / CARD_FILE), path_in_repo=CARD_FILE,
                                   repo_id=repo_id, commit_message='Model card')
    lines.append('pushed')
    return lines
