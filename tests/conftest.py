"""Test setup: fetch timm's own model test suite from the timm sdist on PyPI (never committed)."""
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TIMM_SUITE_VERSION = '1.0.31'
SUITE_DIR = Path(__file__).parent / 'timm_suite'
SUITE_FILE = SUITE_DIR / 'test_models.py'
STAMP = SUITE_DIR / '.timm_version'

os.environ.setdefault('HF_HUB_DISABLE_TELEMETRY', '1')


def _fetch_timm_suite() -> None:
    if SUITE_FILE.exists() and STAMP.exists() and STAMP.read_text().strip() == TIMM_SUITE_VERSION:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--no-binary', ':all:',
               f'timm=={TIMM_SUITE_VERSION}', '-d', tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(
                f'Could not download the timm {TIMM_SUITE_VERSION} sdist for its model tests (needs PyPI access):\n'
                f'{result.stderr}\nDeselect them with --ignore=tests/timm_suite if offline.')
        sdist = next(Path(tmp).glob('timm-*.tar.gz'))
        with tarfile.open(sdist) as tar:
            member = tar.getmember(f'timm-{TIMM_SUITE_VERSION}/tests/test_models.py')
            SUITE_FILE.write_bytes(tar.extractfile(member).read())
    STAMP.write_text(TIMM_SUITE_VERSION)


def pytest_configure(config):
    ignored = [str(p) for p in (config.getoption('ignore') or [])]
    if not any('timm_suite' in p for p in ignored):
        _fetch_timm_suite()
