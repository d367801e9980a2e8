"""Build steps that pyproject.toml cannot declare (all metadata lives there).

1. The lazy import hook: ships ``timm_odevit/_autoload.py`` a second time as the top-level module
   ``_timm_odevit_autoload`` plus ``timm_odevit_autoload.pth`` and its Python 3.15+ twin ``timm_odevit_autoload.start``
   at the root of site-packages, for both ``pip install .`` (build_py) and ``pip install -e .`` (editable_wheel).
   Start-up then imports only that one small module, never the package (see timm_odevit/_autoload.py).
2. The demo's data (non-editable builds only): the weights folder that ``python -m timm_odevit`` serves and the
   1,000-image Fashion-MNIST sample are copied from ``weights/`` and ``tests/data/`` into
   ``timm_odevit/_bundled/`` of the build, so the main command runs from a normal install, offline, from any
   directory, while git holds each blob once. An editable install reads them from the checkout instead.
"""
import ast
import json
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
SRC = HERE / 'timm_odevit' / '_autoload.py'
DEMO = HERE / 'timm_odevit_tools' / 'hub' / 'demo.py'


def _consts(path: Path = SRC) -> dict:
    # read plain literals from a module without importing the package (no torch at build time)
    tree = ast.parse(path.read_text())
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


def bundle_files() -> dict:
    """Path inside the build -> source file (or a bytes payload), for the demo's weights and sample.

    The bundled manifest is the checkout's manifest restricted to the bundled repos, so the mirror checks the copies
    against the same sha256 values that git holds. A source missing from the tree (a trimmed sdist) is left out;
    the demo then says what is missing and how to get it.
    """
    c = _consts(DEMO)
    pkg = Path('timm_odevit') / c['BUNDLE_DIR']
    out: dict = {}
    weights = HERE / 'weights'
    manifest_path = weights / 'MANIFEST.json'
    if manifest_path.is_file():
        files = json.loads(manifest_path.read_text()).get('files', {})
        own = {k: v for k, v in files.items() if (weights / k).is_file()}
        if own:
            for rel in own:
                out[pkg / 'weights' / rel] = weights / rel
            out[pkg / 'weights' / 'MANIFEST.json'] = (json.dumps({'format': 1, 'files': own}, indent=2,
                                                                  sort_keys=True) + '\n').encode()
    sample = HERE / 'tests' / 'data' / c['SAMPLE_NAME']
    if sample.is_dir():
        for f in sorted(sample.iterdir()):
            if f.is_file():
                out[pkg / c['SAMPLE_NAME'] / f.name] = f
    return out


class BuildPyWithHook(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, 'editable_mode', False):
            return
        for name, text in hook_files().items():
            (Path(self.build_lib) / name).write_text(text)
        for rel, src in bundle_files().items():
            dst = Path(self.build_lib) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(src, bytes):
                dst.write_bytes(src)
            else:
                shutil.copyfile(src, dst)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        extra = [] if getattr(self, 'editable_mode', False) else (
            [str(Path(self.build_lib) / n) for n in hook_files()]
            + [str(Path(self.build_lib) / rel) for rel in bundle_files()])
        return super().get_outputs(include_bytecode) + extra


class SdistWithBundle(sdist):
    # an sdist must carry the bundle's sources so that a wheel built from it bundles them too
    def add_defaults(self) -> None:
        super().add_defaults()
        sources = {src for src in bundle_files().values() if isinstance(src, Path)}
        sources.add(HERE / 'weights' / 'MANIFEST.json')
        self.filelist.extend(str(p.relative_to(HERE)) for p in sorted(sources) if p.is_file())


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


setup(cmdclass={'build_py': BuildPyWithHook, 'editable_wheel': EditableWheelWithHook, 'sdist': SdistWithBundle})
