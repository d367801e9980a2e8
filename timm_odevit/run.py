"""Launcher for timm's unmodified scripts: ``python -m timm_odevit.run path/to/validate.py [script args...]``.

Imports timm_odevit (registering every model), then runs the script as ``__main__`` with ``sys.argv`` set to the
script and its own arguments, as if it had been started with ``python path/to/validate.py ...``.
"""
import runpy
import sys
from pathlib import Path
from typing import List, Optional

import timm_odevit  # noqa: F401  (the point of the launcher: register our models before the script runs)


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if not script.is_file():
        raise SystemExit(f'{script}: no such script. Give the path to timm\'s train.py / validate.py (from a clone '
                         'of github.com/huggingface/pytorch-image-models).')
    sys.argv = [str(script)] + argv[1:]
    # the script's own folder first on sys.path, as `python script.py` would do
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name='__main__')


if __name__ == '__main__':
    main()
