"""Lazy import hook: the first ``import timm`` in a process also imports ``timm_odevit`` (registering its models).

Installed with the package as ``timm_odevit_autoload.pth`` (Python <= 3.14 runs its ``import`` line at start-up) and
a ``timm_odevit_autoload.start`` twin (Python 3.15+ start-up entry points, which replace ``.pth`` import lines).
Both call ``install()`` of this file, shipped as the top-level module ``_timm_odevit_autoload`` so that start-up
never imports the package itself (which would import torch and timm). ``install()`` only puts a tiny finder on
``sys.meta_path``; nothing else happens until ``timm`` is imported, so an interpreter that never imports timm pays
for one small module. A failure while registering becomes a warning: ``import timm`` itself never breaks.

Switch it off with ``TIMM_ODEVIT_AUTOLOAD=0``. Other routes for timm's scripts: ``train.py --device-modules
timm_odevit`` and ``python -m timm_odevit.run path/to/validate.py ...``.
"""
# start-up cost matters here (this runs in every interpreter): only modules Python has already loaded by then
import os
import sys

if False:  # typing only; importing typing at start-up would cost milliseconds
    from typing import Any, Optional, Sequence  # noqa: F401

__all__ = ['ENV_VAR', 'PTH_NAME', 'PTH_LINE', 'START_LINE', 'MODULE_NAME', 'install', 'uninstall', 'enabled']

ENV_VAR = 'TIMM_ODEVIT_AUTOLOAD'
MODULE_NAME = '_timm_odevit_autoload'
PTH_NAME = 'timm_odevit_autoload'
# .pth import lines run in site's namespace, one line each, and site prints a traceback for any that raises, at every
# start-up: so the line is one guarded statement that swallows everything a missing or broken module does (ImportError,
# any exception, even SystemExit). Plain literals (no f-strings): setup.py reads these with ast.literal_eval.
PTH_LINE = ("import os; os.environ.get('TIMM_ODEVIT_AUTOLOAD', '1') == '0' or exec("
            "'try:\\n import _timm_odevit_autoload\\n _timm_odevit_autoload.install()\\n"
            "except (Exception, SystemExit):\\n pass')\n")
START_LINE = '_timm_odevit_autoload:install\n'


def enabled() -> bool:
    """False when ``TIMM_ODEVIT_AUTOLOAD`` is 0/false/no/off."""
    return os.environ.get(ENV_VAR, '1').strip().lower() not in ('0', 'false', 'no', 'off')


class _Loader:
    """Runs timm's own loader, then registers our models once timm is fully imported."""

    def __init__(self, inner: 'Any') -> None:
        self.inner = inner

    def create_module(self, spec: 'Any') -> 'Any':
        return self.inner.create_module(spec)

    def exec_module(self, module: 'Any') -> None:
        self.inner.exec_module(module)
        # restore the real loader so reloads and introspection see timm's own
        module.__spec__.loader = self.inner
        module.__loader__ = self.inner
        try:
            import importlib
            importlib.import_module('timm_odevit')
        except (Exception, SystemExit) as e:  # a broken plugin, even one calling sys.exit(), never breaks `import timm`
            import warnings
            warnings.warn(f'timm_odevit autoload: could not register models on `import timm` ({type(e).__name__}: '
                          f'{e}); import timm_odevit explicitly to see the error, or set {ENV_VAR}=0.',
                          RuntimeWarning, stacklevel=2)


class _TimmFinder:
    """Intercepts the first import of ``timm`` only; every other name costs one string comparison."""

    def find_spec(self, fullname: str, path: 'Optional[Sequence[str]]' = None, target: 'Any' = None) -> 'Any':
        if fullname != 'timm':
            return None
        uninstall()  # one shot: the real finders take it from here
        try:
            spec = None
            # ask the remaining finders in order (editable installs of timm bring their own)
            for finder in list(sys.meta_path):
                find = getattr(finder, 'find_spec', None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
            if spec is None or spec.loader is None:
                return spec
            spec.loader = _Loader(spec.loader)
            return spec
        except Exception as e:
            import warnings
            warnings.warn(f'timm_odevit autoload disabled: {type(e).__name__}: {e}', RuntimeWarning)
            return None


def install() -> None:
    """Put the finder on sys.meta_path (no-op when disabled, when timm is already imported, or twice). Never raises:
    it runs at every interpreter start-up (the .start entry point calls it unguarded)."""
    try:
        if not enabled() or 'timm' in sys.modules:
            return
        if not any(isinstance(f, _TimmFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _TimmFinder())
    except Exception:
        pass


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TimmFinder)]
