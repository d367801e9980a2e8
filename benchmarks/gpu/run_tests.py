"""Run tests/test_cuda.py where pytest is not installed (the GPU machine's own environment may lack it).

A stand-in ``pytest`` module gives the file the decorators it uses (``mark.skipif``, ``mark.parametrize``,
``fixture``) and ``skip``; every ``test_*`` function then runs once per parameter, with TF32 off as the file's autouse
fixture asks. Prints one line per test and a pytest-like summary (a skipped test counted as skipped); exit status 1
when any test failed.
Usage: ``python benchmarks/gpu/run_tests.py`` from the checkout root.
"""
import importlib.util
import sys
import time
import traceback
import types
from pathlib import Path


def _stand_in_pytest() -> types.ModuleType:
    mod = types.ModuleType('pytest')

    class Mark:
        @staticmethod
        def skipif(condition, reason=''):
            return lambda f: f  # the runner checks for CUDA itself

        @staticmethod
        def parametrize(names, values):
            def deco(f):
                f.params = [(names, v) for v in values]
                return f
            return deco

    def fixture(*args, **kwargs):
        if args and callable(args[0]):
            args[0].is_fixture = True
            return args[0]

        def deco(f):
            f.is_fixture = True
            return f
        return deco

    def skip(reason: str = '') -> None:
        raise Skipped(reason)

    mod.mark = Mark()
    mod.fixture = fixture
    mod.skip = skip
    mod.skip.Exception = Skipped
    return mod


class Skipped(Exception):
    """``pytest.skip`` in the stand-in: the test counts as skipped, not failed."""


def main() -> int:
    sys.modules.setdefault('pytest', _stand_in_pytest())
    import torch
    if not torch.cuda.is_available():
        print('tests/test_cuda.py: 0 passed, all skipped (no CUDA device)')
        return 0
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    path = Path(__file__).resolve().parents[2] / 'tests' / 'test_cuda.py'
    spec = importlib.util.spec_from_file_location('test_cuda', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    passed, skipped, failed = 0, 0, []
    start = time.time()
    for name, fn in vars(module).items():
        if not name.startswith('test_') or not callable(fn):
            continue
        for argname, value in getattr(fn, 'params', [(None, None)]):
            label = f'{name}[{value}]' if argname else name
            try:
                fn(**({argname: value} if argname else {}))
                passed += 1
                print(f'PASSED {label}')
            except Skipped as e:
                skipped += 1
                print(f'SKIPPED {label}: {e}')
            except Exception:  # noqa: BLE001 -- a failing test is reported, the others still run
                failed.append(label)
                print(f'FAILED {label}\n{traceback.format_exc(limit=3)}')
    print(f'{len(failed)} failed, {passed} passed, {skipped} skipped in {time.time() - start:.1f}s (without pytest)')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
