"""The README's table of published weights, read from the model cards (one source of truth: the cards)."""
import re
from pathlib import Path
from typing import Dict, List

from . import CARD_FILE

__all__ = ['card_facts', 'training_budget', 'weights_table']

_FIELDS = {
    'params': r'\*\*Params \(M\):\*\* ([\d.]+)',
    'gmacs': r'\*\*GMACs:\*\* ([\d.]+)',
    'image': r'\*\*Image size:\*\* (\d+) x \d+, (\d) channel',
    'sample': r'sample \(1,000 test images, bundled\): top-1 ([\d.]+)%',
    'test': r'Fashion-MNIST test set \(10,000 images\): top-1 ([\d.]+)%',
}


def card_facts(repo_dir: Path) -> Dict[str, str]:
    """Params, GMACs, input size and the two top-1 figures a model card states (ValueError naming what is missing)."""
    card = (Path(repo_dir) / CARD_FILE).read_text(encoding='utf-8')
    facts = {}
    for key, pattern in _FIELDS.items():
        m = re.search(pattern, card)
        if not m:
            raise ValueError(f'{repo_dir / CARD_FILE} lacks its {key}: re-export it with python -m timm_odevit.hub '
                             'export or python -m timm_odevit.study export.')
        facts[key] = m.group(1) if key != 'image' else f'{m.group(2)}x{m.group(1)}x{m.group(1)}'
    return facts


def training_budget(repo_dir: Path) -> str:
    """Images seen in training, from the card's recipe: each stage's training images times its epochs, e.g.
    '660k (11 epochs of 60,000)' (ValueError when the card states no recipe)."""
    card = (Path(repo_dir) / CARD_FILE).read_text(encoding='utf-8')
    sizes = [int(n) for n in re.findall(r'data: (\d+) (?:Fashion-MNIST )?training images', card)]
    epochs = [int(n) for n in re.findall(r'schedule: (\d+) epochs', card)]
    if not sizes or len(sizes) != len(epochs):
        raise ValueError(f'{repo_dir / CARD_FILE} states no training data and schedule per stage: re-export it with '
                         'python -m timm_odevit.hub export.')
    seen = sum(n * e for n, e in zip(sizes, epochs))
    of = f'of {sizes[0]:,}' if len(set(sizes)) == 1 else 'in all'
    return f'{seen / 1000:,.0f}k ({sum(epochs)} epochs {of})'


def weights_table(root: Path) -> str:
    """Markdown: one row per ``<arch>.<tag>`` folder under ``root``, sorted by name."""
    lines: List[str] = ['| weights (`pretrained=True`) | input | params (M) | GMACs | training images seen | '
                        'top-1 sample (1,000) | top-1 test (10,000) |', '|---|---|---:|---:|---|---:|---:|']
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        f = card_facts(repo)
        lines.append(f'| `{repo.name}` | {f["image"]} | {f["params"]} | {f["gmacs"]} | {training_budget(repo)} | '
                     f'{f["sample"]}% | {f["test"]}% |')
    return '\n'.join(lines) + '\n'
