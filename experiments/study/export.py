"""Publish the study's models: the best run of each family exported to ``weights/<arch>.<tag>/`` with a card that
carries its training command and its measured top-1 (``hub.export.export_checkpoint``, which any run folder of
``python -m timm_odevit_tools.train`` goes through too)."""
import json
from pathlib import Path
from typing import Any, Dict, Optional

from timm_odevit_tools.hub.export import export_checkpoint
from .runs import STUDY_PAIRS

__all__ = ['best_runs', 'export_run']


def best_runs(root: Path) -> Dict[str, Path]:
    """arch -> the finished run folder with the highest final validation top-1 (over seeds)."""
    best: Dict[str, Path] = {}
    score: Dict[str, float] = {}
    for dense, ssog, _ in STUDY_PAIRS.values():
        for arch in (dense, ssog):
            for run_path in sorted((Path(root) / 'runs').glob(f'{arch}-seed*')):
                res = run_path / 'results.json'
                top1 = json.loads(res.read_text())['top1'] if res.is_file() else None
                if top1 is not None and top1 > score.get(arch, -1.):
                    best[arch], score[arch] = run_path, top1
    return best


def export_run(
        run_path: Path,
        tag: str,
        pretrained_cfg: Dict[str, Any],
        root: str = 'weights',
        description: Optional[str] = None,
        full_test: bool = True,
) -> Dict[str, Any]:
    """Export the end of one run (``last.pth.tar``) to ``root/<arch>.<tag>/``."""
    return export_checkpoint(str(Path(run_path) / 'last.pth.tar'), tag, root, pretrained_cfg, description, full_test)
