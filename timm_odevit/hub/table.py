"""The tables of published weights, read from the model cards (one source of truth: the cards) and the committed
training logs: the README's weights table, the matched SSoG-minus-dense comparison, and the learning curves."""
import csv
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from ..models.families import SETTINGS, Family, family_of
from . import CARD_FILE

__all__ = ['card_command', 'card_facts', 'learning_curves', 'matched_table', 'steered_table', 'training_budget',
           'weights_table']

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


def card_command(repo_dir: Path) -> Optional[str]:
    """The command that trained a one-stage weight, as its card states it (None for a multi-stage card)."""
    card = (Path(repo_dir) / CARD_FILE).read_text(encoding='utf-8')
    commands = re.findall(r'command: `([^`]+)`', card)
    return commands[0] if len(commands) == 1 else None


def _same_recipe(a: Optional[str], b: Optional[str], arch_a: str, arch_b: str) -> bool:
    return a is not None and b is not None and a.replace(arch_a, '@') == b.replace(arch_b, '@')


def _published(root: Path) -> Iterator[Tuple[Path, Family]]:
    """Each weights folder under ``root`` in name order, with its model's family."""
    for repo in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        yield repo, family_of(repo.name.partition('.')[0])


def _trained_alike(repo: Path, family: Family, *families: str) -> Optional[List[Path]]:
    """The folders of the other ``families`` at the size and tag of ``repo`` when each is published and one command
    (the model name aside) trained it and ``repo``; None otherwise."""
    arch, _, tag = repo.name.partition('.')
    size = arch[len(family.name):]
    others = [repo.parent / f'{name}{size}.{tag}' for name in families]
    if all(o.is_dir() and _same_recipe(card_command(repo), card_command(o), arch, name + size)
           for o, name in zip(others, families)):
        return others
    return None


def matched_table(root: Path) -> str:
    """Markdown: SSoG minus its dense twin, one row per SSoG weight whose twin is published under the same tag and
    was trained by the same command (the model name aside); pairs with other recipes are left out, not compared."""
    from ..study.report import PAPER_GAIN
    lines = ['| setting | SSoG weights | top-1 SSoG | dense twin | top-1 dense | SSoG minus dense (points) | '
             'paper gain | training images seen |', '|---|---|---:|---|---:|---:|---:|---|']
    for repo, family in _published(root):
        twin = _trained_alike(repo, family, family.twin) if family.is_ssog else None
        if twin is None:
            continue
        s, d = float(card_facts(repo)['test']), float(card_facts(twin[0])['test'])
        setting = 'steered' if family.steer else family.depth
        lo, hi = PAPER_GAIN[setting]
        lines.append(f'| {setting} | `{repo.name}` | {s:.2f}% | `{twin[0].name}` | {d:.2f}% | {s - d:+.2f} | '
                     f'+{lo} to +{hi} | {training_budget(repo)} |')
    return '\n'.join(lines) + '\n'


def steered_table(root: Path) -> str:
    """Markdown: dense twin vs fixed vs steered SSoG, one row per steered SSoG weight whose dense twin and
    fixed-kernel SSoG sibling are published under the same tag and were trained by the same command (model name
    aside): top-1 and parameters of each, steered minus fixed and steered minus dense."""
    from ..study.report import PAPER_GAIN, PAPER_STEER_GAIN
    lines = ['| setting | dense twin | fixed SSoG | steered SSoG | steered minus fixed (points) | '
             'steered minus dense (points) | training images seen |', '|---|---|---|---|---:|---:|---|']
    for repo, family in _published(root):
        others = _trained_alike(repo, family, family.twin, SETTINGS[family.depth][0]) if family.steer else None
        if others is None:
            continue
        dense, fixed, steered = (card_facts(r) for r in (*others, repo))
        cells = [f'`{r.name}` {f["test"]}% ({f["params"]}M)' for r, f in zip((*others, repo), (dense, fixed, steered))]
        top1 = float(steered['test'])
        lo, hi = PAPER_GAIN['steered']
        lines.append(f'| {family.depth} | {" | ".join(cells)} | {top1 - float(fixed["test"]):+.2f} (paper '
                     f'+{PAPER_STEER_GAIN}) | {top1 - float(dense["test"]):+.2f} (paper +{lo} to +{hi}) | '
                     f'{training_budget(repo)} |')
    return '\n'.join(lines) + '\n'


def learning_curves(logs: Path) -> str:
    """Markdown: validation top-1 after each epoch of every run of the training command under ``logs`` (its
    ``summary.csv``), with the EMA weights' top-1 after the last epoch where the run kept an EMA."""
    from ..train import recorded_args
    lines = ['| run | validation images | top-1 after each epoch | EMA after the last |', '|---|---:|---|---:|']
    for run in sorted(p for p in Path(logs).iterdir() if (p / 'summary.csv').is_file()):
        with open(run / 'summary.csv', newline='') as f:
            rows = list(csv.DictReader(f))
        if not rows:
            continue
        val = recorded_args((run / 'command.txt').read_text().splitlines()[0]).val_samples
        ema = rows[-1].get('eval_ema_top1') or ''
        curve = ', '.join(f'{float(r["eval_top1"]):.1f}' for r in rows)
        lines.append(f'| `{run.name}` | {val or "all"} | {curve} | {f"{float(ema):.1f}" if ema else "-"} |')
    return '\n'.join(lines) + '\n'
