"""README and docs/ stay true: generated tables equal their generators, code examples run and do what their
comments say, commands and links point at things that exist, and the README stays a landing page.

Conventions the pages follow (docs/testing.md):

- A results table sits between ``<!-- table: COMMAND -->`` and ``<!-- end table -->``; COMMAND is the command that
  prints it, and ``GENERATORS`` below maps it to the function that command runs.
- In a ```python block, a line ``EXPR  # -> TEXT`` states that ``str(EXPR) == TEXT``; the test asserts exactly that.
  All python blocks of one page run in order in one fresh interpreter, from the repository root, with
  ``HF_ENDPOINT`` pointing at a local mirror over ``weights/`` (as the pages tell users to set it up).
"""
import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest

from timm_odevit_tools.hub.demo import hub_env
from timm_odevit_tools.hub.server import HubMirror
from tiers import slow_except

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / 'README.md'
DOCS = REPO_ROOT / 'docs'
PAGES = [README] + sorted(DOCS.glob('*.md'))
README_MAX_LINES = 250

_TABLE = re.compile(r'<!-- table: (?P<cmd>[^>]+?) -->\n(?P<body>.*?)\n<!-- end table -->', re.S)
_FENCE = re.compile(r'^```(?P<lang>\w*)\n(?P<body>.*?)^```$', re.S | re.M)
_CHECK = re.compile(r'^(?P<indent>\s*)(?P<expr>.+?)\s+# -> (?P<want>.+?)\s*$')


def _study_report() -> str:
    from experiments.study.report import write_report
    import tempfile
    # write_report also writes files: regenerate into a copy of the committed study folder
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / 'study'
        shutil.copytree(REPO_ROOT / 'results' / 'fmnist_study', root)
        return write_report(root)


GUIDANCE_VARIANTS = ('results/guidance', 'results/guidance_noinit', 'results/guidance_rawmse')
# the state distances from scratch, guided by the 25-epoch dense weight (the first three had its 10-epoch one)
STATE_NORM_VARIANTS = ('results/guidance_t90_layernorm', 'results/guidance_t90_gram', 'results/guidance_t90_noinit')


def _guidance_variants(dirs: Tuple[str, ...]) -> Callable[[], str]:
    def gen() -> str:
        from experiments.study.guidance import guidance_variants
        return guidance_variants([REPO_ROOT / d for d in dirs])
    return gen


def _elasticity(folder: str) -> Callable[[], str]:
    # rendered from the committed elasticity.csv, as the command renders it after measuring
    def gen() -> str:
        from experiments.study.elasticity import elasticity_table, read_rows
        return elasticity_table(read_rows(REPO_ROOT / folder / 'elasticity.csv'))
    return gen


def _trajectory() -> str:
    from experiments.study.guidance import read_trajectory, trajectory_table
    return trajectory_table(read_trajectory(REPO_ROOT / 'results' / 'weights' / 'trajectory.csv'))


def _guidance_report(folder: str) -> Callable[[], str]:
    # rendered from the folder's committed data (study.json, each run's results.json and full_test.json, the
    # trajectory in guidance.csv); the command also measures that trajectory, from checkpoints not committed
    def gen() -> str:
        from experiments.study.guidance import guidance_report
        return guidance_report(REPO_ROOT / 'results' / folder)
    return gen


def _zoo(table: str) -> Callable[[], str]:
    def gen() -> str:
        from timm_odevit_tools.zoo import TABLES
        from timm_odevit.models.families import SIZES
        return TABLES[table](list(SIZES)) if table in ('params', 'reduction') else TABLES[table]()
    return gen


def _cost_model() -> str:
    path = REPO_ROOT / 'benchmarks' / 'gpu_cost_model.py'
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, check=True).stdout


def _weights(kind: str) -> Callable[[], str]:
    def gen() -> str:
        from experiments.tables import guided_table, learning_curves, matched_table, steered_table, weights_table
        if kind == 'curves':
            return learning_curves(REPO_ROOT / 'results' / 'weights')
        if kind == 'steered':
            return steered_table(REPO_ROOT / 'results' / 'weights', REPO_ROOT / 'weights')
        table = {'matched': matched_table, 'guided': guided_table, 'weights': weights_table}[kind]
        return table(REPO_ROOT / 'weights')
    return gen


# command named in a page's table marker -> the function that command runs (same arguments)
GENERATORS: Dict[str, Callable[[], str]] = {
    'python -m timm_odevit_tools.zoo grid': _zoo('grid'),
    'python -m timm_odevit_tools.zoo params': _zoo('params'),
    'python -m timm_odevit_tools.zoo reduction': _zoo('reduction'),
    'python -m timm_odevit_tools.zoo paper': _zoo('paper'),
    'python benchmarks/gpu_cost_model.py': _cost_model,
    'python -m experiments.weights table --root weights': _weights('weights'),
    'python -m experiments.weights table --kind matched --root weights': _weights('matched'),
    'python -m experiments.weights table --kind guided --root weights': _weights('guided'),
    'python -m experiments.weights table --kind steered --logs results/weights --root weights': _weights('steered'),
    'python -m experiments.weights table --kind curves --logs results/weights': _weights('curves'),
    'python -m experiments.study report': _study_report,
    'python -m experiments.study elasticity (writes results/fmnist_study/elasticity.md)':
        _elasticity('results/fmnist_study'),
    'python -m experiments.weights elasticity --root weights --looped-as-ode (writes results/weights/elasticity.md)':
        _elasticity('results/weights'),
    'python -m experiments.weights elasticity --root weights --test-samples 10000 --out-dir results/weights/full_test '
    '--jobs 2 (writes results/weights/full_test/elasticity.md)': _elasticity('results/weights/full_test'),
    'python -m experiments.weights trajectory --root weights (writes results/weights/trajectory.md)':
        _trajectory,
    'python -m experiments.study guidance-report (writes results/guidance/guidance.md)':
        _guidance_report('guidance'),
    'python -m experiments.study guidance-report --out-dir results/guidance_noinit '
    '(writes results/guidance_noinit/guidance.md)': _guidance_report('guidance_noinit'),
    'python -m experiments.study guidance-report --out-dir results/guidance_full --full-test '
    '(writes results/guidance_full/guidance.md)': _guidance_report('guidance_full'),
    f'python -m experiments.study guidance-variants --out-dirs {" ".join(GUIDANCE_VARIANTS)}':
        _guidance_variants(GUIDANCE_VARIANTS),
    f'python -m experiments.study guidance-variants --out-dirs {" ".join(STATE_NORM_VARIANTS)}':
        _guidance_variants(STATE_NORM_VARIANTS),
    'python -m experiments.study guidance-report --out-dir results/guidance_t90_gram '
    '(writes results/guidance_t90_gram/guidance.md)': _guidance_report('guidance_t90_gram'),
}


def _tables() -> List[Tuple[Path, str, str]]:
    return [(p, m['cmd'], m['body']) for p in PAGES for m in _TABLE.finditer(p.read_text())]


def _rel(p: Path) -> str:
    return p.relative_to(REPO_ROOT).as_posix()


def test_readme_is_a_landing_page():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f'README has {len(text.splitlines())} lines; move to docs/'
    # the two set-up commands, as CI runs them
    ci = (REPO_ROOT / '.ci' / 'run').read_text()
    setup = _FENCE.search(text[text.index('## Set-up'):])
    lines = [ln for ln in setup['body'].splitlines() if ln.strip()]
    assert len(lines) == 2 and lines[1] == 'python -m pytest', lines
    assert ci.rstrip().endswith('\npython -m pytest'), 'CI must end with exactly the README test command'
    for page in ('models', 'hub', 'import_hook', 'training', 'experiments', 'benchmark', 'testing'):
        assert f'docs/{page}.md' in text, f'README does not link docs/{page}.md'


# history belongs in CHANGELOG.md: the pages describe the project as it is (generated tables aside, which quote their
# results files)
_DIARY = re.compile(r'\bsessions?\b|\bissues? \d+|\bissue-\d+|\(historical\)', re.I)


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_pages_describe_today_not_history(page):
    text = _TABLE.sub('', page.read_text())
    found = [(text[:m.start()].count('\n') + 1, m[0]) for m in _DIARY.finditer(text)]
    assert not found, f'{_rel(page)} narrates history at (line in the page without its tables, words) {found}: ' \
                      f'describe today and move what happened to CHANGELOG.md'


def test_pages_count_the_registered_models():
    import timm
    import timm_odevit  # noqa: F401
    registered = len(timm.list_models(module=['odevit', 'ssog']))
    for page in (README, DOCS / 'models.md'):
        counts = re.findall(r'(\d+) models in all', page.read_text())
        assert counts == [str(registered)], f'{_rel(page)} says {counts} models in all; {registered} are registered'


def test_every_generated_table_is_known():
    found = _tables()
    assert {c for _, c, _ in found} >= {'python -m timm_odevit_tools.zoo grid',
                                        'python -m timm_odevit_tools.zoo params',
                                        'python -m experiments.weights table --root weights'}
    unknown = [(_rel(p), c) for p, c, _ in found if c not in GENERATORS]
    assert not unknown, f'tables with no registered generator: {unknown}'
    # a block that swallows the next one (an empty body matches up to a later end marker) hides that one's check
    for page in PAGES:
        text = page.read_text()
        blocks = [m['body'] for m in _TABLE.finditer(text)]
        opened, ended = (len(re.findall(rf'^{marker}', text, re.M)) for marker in ('<!-- table: ', '<!-- end table'))
        assert len(blocks) == opened == ended, f'{_rel(page)}: a table block without its own end marker or body'
        assert not [b for b in blocks if '<!-- table: ' in b], f'{_rel(page)}: a table block holds another'


@pytest.mark.parametrize('cmd', sorted(GENERATORS))
def test_generated_table_equals_its_generator(cmd):
    blocks = [(p, body) for p, c, body in _tables() if c == cmd]
    if not blocks:
        pytest.skip(f'no page holds the table of {cmd!r}')
    want = GENERATORS[cmd]().strip()
    for page, body in blocks:
        assert body.strip() == want, f'{_rel(page)}: table of `{cmd}` is stale; paste its output again'


def test_zoo_command_prints_its_table():
    r = subprocess.run([sys.executable, '-m', 'timm_odevit_tools.zoo', 'grid'], capture_output=True, text=True,
                       timeout=300, cwd=str(REPO_ROOT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == GENERATORS['python -m timm_odevit_tools.zoo grid']().strip()


def _links(page: Path) -> List[str]:
    text = _FENCE.sub('', page.read_text())
    return [m for m in re.findall(r'\]\(([^)\s]+)\)', text) if not re.match(r'[a-z]+:', m)]


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = [ln for ln in _links(page) if ln.split('#')[0] and not (page.parent / ln.split('#')[0]).exists()]
    assert not broken, f'{_rel(page)}: broken links {broken}'


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_commands_name_modules_that_exist(page):
    missing = []
    for m in _FENCE.finditer(page.read_text()):
        if m['lang'] in ('bash', 'sh', ''):
            for mod in re.findall(r'python -m ([\w.]+)', m['body']):
                if mod.startswith(('timm_odevit', 'experiments')) and importlib.util.find_spec(mod) is None:
                    missing.append(mod)
    assert not missing, f'{_rel(page)}: commands name modules that do not exist: {missing}'


def checked_script(source: str) -> str:
    """The page's python blocks as one script in which every ``EXPR  # -> TEXT`` line asserts str(EXPR) == TEXT."""
    out = []
    for n, line in enumerate(source.splitlines(), 1):
        m = _CHECK.match(line)
        if m:
            ast.parse(m['expr'].strip(), mode='eval')  # a check must be an expression, never a statement
            want = m['want']
            line = (f"{m['indent']}__v = ({m['expr'].strip()}); assert str(__v) == {want!r}, "
                    f"f'line {n}: {{__v!s}} != ' + {want!r}")
        out.append(line)
    return '\n'.join(out) + '\n'


def _python_blocks(page: Path) -> str:
    return '\n'.join(m['body'] for m in _FENCE.finditer(page.read_text()) if m['lang'] == 'python')


def test_checked_script_fails_when_a_comment_lies(tmp_path):
    # the mechanism itself can fail: a false claim must raise
    good = subprocess.run([sys.executable, '-c', checked_script('x = 6 * 2\nx  # -> 12')], capture_output=True)
    bad = subprocess.run([sys.executable, '-c', checked_script('x = 6 * 2\nx  # -> 13')], capture_output=True,
                         text=True)
    assert good.returncode == 0 and bad.returncode != 0 and '12 != 13' in bad.stderr


@pytest.fixture(scope='module')
def mirror():
    with HubMirror(str(REPO_ROOT / 'weights')) as m:
        yield m


@pytest.mark.parametrize('page', slow_except([p for p in PAGES if '```python' in p.read_text()],
                                              fast=lambda p: p.name in ('guide.md', 'testing.md')), ids=_rel)
def test_python_examples_run_and_do_what_their_comments_say(page, mirror, tmp_path):
    script = checked_script(_python_blocks(page))
    r = subprocess.run([sys.executable, '-c', script], env=hub_env(mirror.url, str(tmp_path / 'hf')),
                       capture_output=True, text=True, timeout=900, cwd=str(REPO_ROOT))
    assert r.returncode == 0, f'{_rel(page)}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}'
