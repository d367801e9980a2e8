"""Build hook for the lazy import hook (all metadata lives in pyproject.toml).

Ships ``timm_odevit/_autoload.py`` a second time as the top-level module ``_timm_odevit_autoload`` plus
``timm_odevit_autoload.pth`` and its Python 3.15+ twin ``timm_odevit_autoload.start`` at the root of site-packages,
for both ``pip install .`` (build_py) and ``pip install -e .`` (editable_wheel). Start-up then imports only that
one small module, never the package (see timm_odevit/_autoload.py).
"""
import ast
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HERE = Path(__file__).resolve().parent
SRC = HERE / 'timm_odevit' / '_autoload.py'


def _consts() -> dict:
    # read the file names and lines from _autoload.py without importing the package (no torch at build time)
    tree = ast.parse(SRC.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def hook_files() -> dict:
    c = _consts()
    return {
        f'{c["MODULE_NAME"]}.py': SRC.read_text(),
        f'{c["PTH_NAME"]}.pth': c['PTH_LINE'],
        f'{c["PTH_NAME"]}.start': c['START_LINE'],
    }


class BuildPyWithHook(build_py):
    def run(self) -> None:
        super().run()
        if not getattr(self, 'editable_mode', False):
            for name, text in hook_files().items():
                (Path(self.build_lib) / name).write_text(text)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        extra = [] if getattr(self, 'editable_mode', False) else [str(Path(self.build_lib) / n) for n in hook_files()]
        return super().get_outputs(include_bytecode) + extra


class EditableWheelWithHook(editable_wheel):
    # editable wheels carry only a path mapping, so build outputs outside the package are added to the wheel here
    def _select_strategy(self, name, tag, build_lib):
        strategy = super()._select_strategy(name, tag, build_lib)

        class WithHook:
            def __enter__(self):
                return strategy.__enter__()

            def __exit__(self, *exc):
                return strategy.__exit__(*exc)

            def __call__(self, wheel, files, mapping):
                strategy(wheel, files, mapping)
                for fname, text in hook_files().items():
                    wheel.writestr(fname, text)

        return WithHook()


setup(cmdclass={'build_py': BuildPyWithHook, 'editable_wheel': EditableWheelWithHook})
