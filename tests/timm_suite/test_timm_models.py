"""timm's own ``tests/test_models.py`` (from the timm sdist, fetched into a cache folder by tests/conftest.py),
executed in this module so that pytest collects its tests here and ``conftest.py`` beside this file applies."""
import os
from pathlib import Path

import pytest

_path = os.environ.get('TIMM_ODEVIT_TIMM_SUITE')
if not _path or not Path(_path).is_file():
    pytest.skip('timm suite not fetched (run through tests/conftest.py, which downloads it)', allow_module_level=True)
exec(compile(Path(_path).read_text(), _path, 'exec'), globals())
