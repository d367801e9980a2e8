"""Demo: the line users type, ``timm.create_model('ssog_ode_small', pretrained=True)``, served by the local Hub
mirror, classifying the bundled 1,000-image Fashion-MNIST sample.

Starts the mirror in-process on a free loopback port, then runs the load in a fresh interpreter with ``HF_ENDPOINT``
pointing at it (huggingface_hub reads HF_ENDPOINT when it is imported, and timm imports it), a fresh ``HF_HOME`` and
a temporary folder as working directory, exactly as a user would. Prints the requests the mirror saw and the top-1.

What it serves and classifies ships with the package: ``pip install .`` copies every published weight (the folders
``weights/MANIFEST.json`` lists, about 30 MB) and the sample into the library's ``timm_odevit/_bundled/`` (setup.py
reads ``BUNDLE_DIR`` and ``SAMPLE_NAME`` below).
An editable install or a plain checkout uses ``weights/`` and ``tests/data/`` of the checkout instead.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from .. import data as fm
from . import MANIFEST_FILE, ORG
from timm_odevit.models.pretrained import local_weights_roots
from .server import HubMirror

__all__ = ['DEFAULT_MODEL', 'DEFAULT_REPO', 'BUNDLE_DIR', 'SAMPLE_NAME', 'weights_root', 'sample_dir', 'hub_env',
           'main']

# Plain literals: setup.py reads them with ast.literal_eval, without importing the package.
DEFAULT_MODEL = 'ssog_ode_small'
BUNDLE_DIR = '_bundled'
# the repo the untagged DEFAULT_MODEL resolves to (models/pretrained.py); a test checks the resolution
DEFAULT_REPO = 'ssog_ode_small.fmnist_64px'
SAMPLE_NAME = 'fashion_mnist_sample'

_PACKAGE = Path(__file__).resolve().parents[2] / 'timm_odevit'  # the bundle belongs to the library's pretrained route
_CHECKOUT = _PACKAGE.parent

_CLIENT = '''
import sys, time, timm, torch
from timm_odevit_tools import data as fm
from timm_odevit_tools.evaluate import evaluate
name, sample, cache = sys.argv[1:4]
print(f">>> timm.create_model({name!r}, pretrained=True)")
t = time.time()
model = timm.create_model(name, pretrained=True)
load_s = time.time() - t
cfg = model.pretrained_cfg
# laid out in a temporary folder: a broken shared cache must never break the first command a user types
x, y = fm.load_tensors(sample, model=model, cache_root=cache)
r = evaluate(model, (x, y))
labels = cfg.get('label_names') or []
with torch.no_grad():
    pred = model(x[:5]).argmax(-1).tolist()
print(f"{cfg.get('architecture')}.{cfg.get('tag')}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
      f"input {tuple(cfg['input_size'])}, loaded in {load_s:.1f} s")
print("first images: " + ", ".join(f"{labels[p] if labels else p} ({'ok' if p == t else 'wrong'})"
                                   for p, t in zip(pred, y[:5].tolist())))
print(f"top-1 on the bundled sample {r['top1']:.2f}% ({r['correct']}/{r['n']}), NFE {r['nfe']}")
'''


def weights_root() -> Optional[Path]:
    """The folder of Hub repos the demo serves: the copy bundled with the package, else a checkout's ``weights/``."""
    return next(iter(local_weights_roots()), None)


def sample_dir() -> Optional[Path]:
    """The 1,000-image Fashion-MNIST sample (``data.SAMPLE_DIR``: a checkout's ``tests/data/``, else the copy bundled
    with the package), or None where neither is there."""
    return fm.SAMPLE_DIR if fm.SAMPLE_DIR.is_dir() else None


def hub_env(endpoint: str, hf_home: str, offline: bool = False) -> Dict[str, str]:
    """Environment for a child interpreter that downloads from ``endpoint`` into ``hf_home`` only."""
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=hf_home, HF_HUB_DISABLE_TELEMETRY='1',
               HF_HUB_OFFLINE='1' if offline else '0')
    env.pop('HF_HUB_CACHE', None)  # would override HF_HOME's cache
    env.pop('HF_TOKEN', None)      # never send a real token to the mirror
    return env


def _missing(model: str, root: Optional[Path], sample: Optional[Path]) -> List[str]:
    what = []
    if root is None:
        what.append(f'a weights folder with {MANIFEST_FILE} (looked in {_PACKAGE / BUNDLE_DIR / "weights"} and '
                    f'{_CHECKOUT / "weights"})')
    elif not any(p.is_dir() and p.name.split('.')[0] == model.split('.')[0] for p in root.iterdir()):
        what.append(f'weights of {model.split(".")[0]} under {root}')
    if sample is None:
        what.append(f'the Fashion-MNIST sample (looked in {_PACKAGE / BUNDLE_DIR / SAMPLE_NAME} and '
                    f'{_CHECKOUT / "tests" / "data" / SAMPLE_NAME})')
    return what


def main(model: Optional[str] = None, root: Optional[str] = None) -> int:
    """Serve ``root`` (default: the bundled weights), load ``model`` through it, print top-1 on the sample.

    Returns 0 on success; otherwise prints what is missing or what failed, and how to get it, and returns 1.
    """
    model = model or DEFAULT_MODEL
    root_p = Path(root) if root else weights_root()
    sample = sample_dir()
    if root_p is not None and sample is not None and root_p.is_dir():
        names = sorted(p.name for p in root_p.iterdir() if (p / 'config.json').is_file())
        if not any(n.split('.')[0] == model.split('.')[0] for n in names):
            print(f'No published weights of {model} under {root_p}; pass one of these with --model: '
                  f'{", ".join(names)}.')
            return 1
    missing = _missing(model, root_p, sample)
    if missing:
        print('The pretrained demo cannot run: missing ' + '; '.join(missing) + '.\n'
              'Both ship inside the package when it is installed from a clone of the repository '
              '(`pip install .`, or a wheel built from one). From a checkout, `python -m timm_odevit_tools.hub demo '
              '--root weights` serves its weights/ folder; `python -m timm_odevit --no-demo` skips the demo.')
        return 1
    with HubMirror(str(root_p)) as mirror, tempfile.TemporaryDirectory(prefix='timm_odevit_demo_') as tmp:
        print(f'Local Hub mirror over {root_p} at {mirror.url} (HF_ENDPOINT), serving {ORG}/<arch>.<tag>')
        # the temporary folder as working directory: `python -c` puts it first on sys.path, never a checkout
        proc = subprocess.run([sys.executable, '-c', _CLIENT, model, str(sample), str(Path(tmp) / 'data')],
                              env=hub_env(mirror.url, str(Path(tmp) / 'hf_home')), cwd=tmp,
                              capture_output=True, text=True, timeout=600)
        for method, path, status in mirror.log:
            print(f'  mirror: {method:4s} {path} -> {status}')
    print(proc.stdout.strip())
    if proc.returncode != 0:
        print(proc.stderr[-3000:].strip(), file=sys.stderr)
        print(f'The pretrained demo failed loading {model} (the error above).', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
