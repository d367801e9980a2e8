"""The README's table of published weights, read from the model cards (one source of truth: the cards)."""
import re
from pathlib import Path
from typing import Dict, List

from . import CARD_FILE

__all__ = ['card_facts', 'weights_table']

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


def weights_table(root: Path) -> str:
    """Markdown: one row per ``<arch>.<tag>`` folder under ``root``, sorted by name."""
    lines: List[str] = ['| weights (`pretrained=True`) | input | params (M) | GMACs | top-1 sample (1,000) | '
                        'top-1 test (10,000) |', '|---|---|---:|---:|---:|---:|']
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        f = card_facts(repo)
        lines.append(f'| `{repo.name}` | {f["image"]} | {f["params"]} | {f["gmacs"]} | {f["sample"]}% | '
                     f'{f["test"]}% |')
    return '\n'.join(lines) + '\n'
