"""Demo: a pretrained model through the local Hub mirror, classifying the bundled Fashion-MNIST sample.

Starts the mirror in-process on a free loopback port over ``weights/``, then runs the load in a fresh interpreter
with ``HF_ENDPOINT`` pointing at it (huggingface_hub reads HF_ENDPOINT when it is imported, and timm imports it) and
a fresh ``HF_HOME``, exactly as a user would: ``timm.create_model('<arch>.fmnist', pretrained=True)``. Prints the
requests the mirror saw and the top-1 on the 1,000-image sample.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional

from . import ORG
from ..models.pretrained import FMNIST_TAG
from .server import HubMirror

__all__ = ['DEFAULT_MODEL', 'WEIGHTS_ROOT', 'hub_env', 'main']

DEFAULT_MODEL = f'ssog_ode_tiny_patch4_32.{FMNIST_TAG}'
WEIGHTS_ROOT = Path(__file__).resolve().parents[2] / 'weights'

_CLIENT = '''
import sys, time, timm, timm_odevit
from timm_odevit.hub.recipe import evaluate
from timm_odevit import data as fm
t = time.time()
model = timm.create_model(sys.argv[1], pretrained=True)
load_s = time.time() - t
r = evaluate(model, str(fm.SAMPLE_DIR))
print(f"{sys.argv[1]}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, loaded in {load_s:.1f} s; "
      f"top-1 on the bundled sample {r['top1']:.2f}% ({r['correct']}/{r['n']})")
'''


def hub_env(endpoint: str, hf_home: str, offline: bool = False) -> Dict[str, str]:
    """Environment for a child interpreter that downloads from ``endpoint`` into ``hf_home`` only."""
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=hf_home, HF_HUB_DISABLE_TELEMETRY='1',
               HF_HUB_OFFLINE='1' if offline else '0')
    env.pop('HF_HUB_CACHE', None)  # would override HF_HOME's cache
    env.pop('HF_TOKEN', None)      # never send a real token to the mirror
    return env


def main(model: Optional[str] = None, root: Optional[str] = None) -> int:
    """Serve ``root`` (default: the repo's weights/), load ``model`` through it, print top-1 on the sample."""
    model = model or DEFAULT_MODEL
    root_p = Path(root) if root else WEIGHTS_ROOT
    if not (root_p / model).is_dir():
        print(f'No published weights {model} under {root_p} (run from a clone of the repository, or pass --root).')
        return 1
    with HubMirror(str(root_p)) as mirror, tempfile.TemporaryDirectory(prefix='hf_home_') as hf_home:
        print(f'Local Hub mirror over {root_p} at {mirror.url} (HF_ENDPOINT), serving {ORG}/<arch>.<tag>')
        proc = subprocess.run([sys.executable, '-c', _CLIENT, model], env=hub_env(mirror.url, hf_home),
                              capture_output=True, text=True, timeout=600)
        for method, path, status in mirror.log:
            print(f'  mirror: {method:4s} {path} -> {status}')
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    print(proc.stdout.strip())
    return 0


if __name__ == '__main__':
    sys.exit(main())
