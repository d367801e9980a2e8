"""Facts the README and docs/ state in prose, checked against their sources: the registry's model count wherever a
page gives it, the published weights' numbers the prose quotes (from their records and cards), the commands the
cards name, and links to headings. tests/test_docs.py checks the generated tables, examples and files linked."""
import importlib.util
import re
from pathlib import Path
from typing import List, Set

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / 'README.md'
DOCS = REPO_ROOT / 'docs'
PAGES = [README] + sorted(DOCS.glob('*.md'))
WEIGHTS = REPO_ROOT / 'weights'

_FENCE = re.compile(r'^```\w*\n.*?^```$', re.S | re.M)
_TABLE = re.compile(r'<!-- table: [^>]+? -->\n.*?\n<!-- end table -->', re.S)

# how the pages give the number of registered models; each phrasing must occur on some page, so a rewording that
# drops a count from the check fails here instead
MODEL_COUNTS = (r'(\d+) models in all', r'all (\d+) of our models', r'every registered model \(all (\d+)')

# a page names the machine a figure was measured on: "this CPU" meant three different machines across the pages
# (tests/test_docs.py keeps sessions and issue numbers off the pages)
UNNAMED_MACHINE = (r'\bthis CPU\b', r'\bthis machine\b')


def _rel(p: Path) -> str:
    return p.relative_to(REPO_ROOT).as_posix()


def _prose(page: Path) -> str:
    """The page without its code blocks and generated tables, whitespace collapsed (a phrase may wrap)."""
    return ' '.join(_TABLE.sub('', _FENCE.sub('', page.read_text())).split())


def test_pages_give_the_registered_model_count_wherever_they_count():
    import timm
    import timm_odevit  # noqa: F401
    registered = str(len(timm.list_models(module=['odevit', 'ssog'])))
    for phrasing in MODEL_COUNTS:
        found = [(_rel(p), n) for p in PAGES for n in re.findall(phrasing, _prose(p))]
        assert found, f'no page counts the models as {phrasing!r} any more: update MODEL_COUNTS'
        wrong = [(page, n) for page, n in found if n != registered]
        assert not wrong, f'{wrong}: {registered} models are registered'


def _ode_grid_gaps() -> List[float]:
    """Full-test top-1 at the tag's solver minus at the architecture's default, for each published weight that has
    both (the weights table's last two columns)."""
    from experiments.tables import weight_facts
    gaps = []
    for repo in sorted(p for p in WEIGHTS.iterdir() if p.is_dir()):
        facts = weight_facts(repo)
        if 'test_default_solver' in facts:
            gaps.append(float(facts['test']) - float(facts['test_default_solver']))
    return gaps


def test_hub_page_gives_the_ode_weights_loss_at_the_default_grid():
    gaps = _ode_grid_gaps()
    assert gaps and all(g > 0 for g in gaps), f'a tiny ODE weight no longer scores lower at 12 steps: {gaps}'
    want = f'{min(gaps):.2f} to {max(gaps):.2f} points lower'
    assert want in _prose(DOCS / 'hub.md'), f'docs/hub.md should say the ODE tags score {want} at the default grid'


# the README's solver claim, as it words it, and the table it cites (every published ODE weight, all test images)
SOLVER_CLAIM = ('Euler at twice the training grid\'s steps, midpoint and RK4 at its cost and dopri5 solve their field '
                'within a point of the grid; at half the cost Euler and midpoint stay within 2 points for all of them, '
                'RK4 (3 steps) for the 23-step ones (the full test set;')
FULL_TEST_ELASTICITY = REPO_ROOT / 'results' / 'weights' / 'full_test' / 'elasticity.csv'


def test_readme_solver_claim_holds_for_every_published_ode_weight_on_the_full_test_set():
    from experiments.study.elasticity import read_rows
    from timm_odevit_tools.hub.record import read_record
    assert SOLVER_CLAIM in _prose(README), 'the README reworded its solver claim: check it and SOLVER_CLAIM again'
    rows = read_rows(FULL_TEST_ELASTICITY)
    top1 = {(r['model'], r['method'], r['steps']): r['top1'] for r in rows}
    # an ODE weight's record names the solver it was trained on (the discrete ones' name none)
    grids = {p.name: read_record(p)['solver'] for p in sorted(WEIGHTS.iterdir()) if p.is_dir()}
    ode = sorted(repo for repo, solver in grids.items() if solver)
    assert ode and sorted({r['model'] for r in rows}) == ode and {r['images'] for r in rows} == {10000}
    for repo in ode:
        method, steps = grids[repo].split(':')
        steps = int(steps)
        grid = top1[repo, method, steps]
        # solvers by their NFE: midpoint spends 2 a step, RK4 4, rounded up to the table's step counts
        within_1 = [('euler', 2 * steps), ('midpoint', -(-steps // 2)), ('rk4', -(-steps // 4)), ('dopri5', 0)]
        within_2 = [('euler', -(-steps // 2)), ('midpoint', -(-steps // 4))] + ([('rk4', 3)] if steps == 23 else [])
        for limit, solvers in ((1, within_1), (2, within_2)):
            lost = {f'{m} {s}': round(grid - top1[repo, m, s], 2) for m, s in solvers
                    if grid - top1[repo, m, s] > limit}
            assert not lost, f'{repo}: more than {limit} point(s) under its grid ({grid}): {lost}'


def test_readme_gives_the_published_guided_gaps_with_their_sign():
    from experiments.tables import guided_pairs, weight_facts
    prose = _prose(README)
    pairs = list(guided_pairs(WEIGHTS))
    assert pairs
    for _, _, scratch, guided in pairs:
        g, s = weight_facts(guided), weight_facts(scratch)
        gaps = [float(g['test']) - float(s['test'])]
        if 'test_default_solver' in g and 'test_default_solver' in s:
            gaps.append(float(g['test_default_solver']) - float(s['test_default_solver']))
        for gap in gaps:
            # a gap of 0.00 may be printed as +0.00 or -0.00: the guided table prints it with a plus
            shown = f'{gap:+.2f}'.replace('-0.00', '+0.00')
            assert re.search(rf'(?<![\d.]){re.escape(shown)}(?![\d])', prose), \
                f'README does not give {guided.name} minus {scratch.name}, {shown} points, in its prose'


def _card_modules() -> Set[str]:
    return {m for card in WEIGHTS.glob('*/README.md') for m in re.findall(r'python -m ([\w.]+)', card.read_text())}


def test_layout_page_names_the_commands_the_cards_name():
    modules = _card_modules()
    assert modules, 'no published card names a command'
    layout = _prose(DOCS / 'layout.md')
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, f'the cards name `python -m {module}`, which is gone'
        assert f'python -m {module}' in layout, f'the cards name `python -m {module}`; docs/layout.md does not'
    # and the sentence saying what the cards name names nothing they do not
    claim = re.search(r'The published model cards name (.+?)\. [A-Z]', layout)
    assert claim, 'docs/layout.md no longer says which commands the published cards name'
    cards = ' '.join(' '.join(c.read_text().split()) for c in WEIGHTS.glob('*/README.md'))
    for command in re.findall(r'`(python -m [\w.]+(?: [a-z]+)?)', claim.group(1)):
        assert command in cards, f'docs/layout.md says the published cards name `{command}`; none does'


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def _anchors(page: Path) -> Set[str]:
    text = _FENCE.sub('', page.read_text())
    seen: dict = {}
    out = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    for m in re.finditer(r'^#{1,6} (.+?)\s*$', text, re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f'{slug}-{n}')
        seen[slug] = n + 1
    return out


def test_slug_is_githubs():
    assert _slug("Teacher guidance, matched (`python -m experiments.study guidance`)") == \
        'teacher-guidance-matched-python--m-experimentsstudy-guidance'
    assert _slug('Distillation: the task behind `--teacher`') == 'distillation-the-task-behind---teacher'


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_links_to_headings_resolve(page):
    text = _FENCE.sub('', page.read_text())
    broken = []
    for link in re.findall(r'\]\(([^)\s]+)\)', text):
        if re.match(r'[a-z]+:', link) or '#' not in link:
            continue
        path, anchor = link.split('#', 1)
        target = (page.parent / path).resolve() if path else page
        if target.suffix == '.md' and target.is_file() and anchor not in _anchors(target):
            broken.append(link)
    assert not broken, f'{_rel(page)}: links to headings that do not exist: {broken}'


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_pages_name_the_machine_a_figure_was_measured_on(page):
    text = ' '.join(page.read_text().split())
    found = [m.group(0) for word in UNNAMED_MACHINE for m in re.finditer(word, text, re.I)]
    assert not found, f'{_rel(page)} says {found}: name the machine (and its date) a figure was measured on'


# training.md gives each group of published weights its stages and epochs, as their records hold them
TRAINING_GROUPS = {
    'four stages, {epochs} epochs': ('dense_vit_tiny_patch4_32.fmnist', 'ssog_vit_tiny_patch4_32.fmnist',
                                    'looped_vit_tiny_patch4_32.fmnist', 'looped_ssog_tiny_patch4_32.fmnist'),
    '{epochs} epochs for the SSoG pair': ('ssog_ode_tiny_patch4_32.fmnist', 'ssog_ode_tiny_patch4_32.fmnist_distilled'),
    '{epochs} epochs for the ODE-ViT pair': ('odevit_tiny_patch4_32.fmnist', 'odevit_tiny_patch4_32.fmnist_distilled'),
    'then four solver-robust stages (one epoch, three, two, then three); {epochs} epochs':
        ('ssog_ode_small.fmnist_64px',),
}


@pytest.mark.parametrize('phrase', sorted(TRAINING_GROUPS))
def test_training_page_gives_each_weights_epochs_as_its_record(phrase):
    import json
    totals = {repo: sum(s['epochs'] for s in json.loads((WEIGHTS / repo / 'record.json').read_text())['stages'])
              for repo in TRAINING_GROUPS[phrase]}
    assert len(set(totals.values())) == 1, f'the group has different budgets: {totals}'
    want = phrase.format(epochs=next(iter(totals.values())))
    assert want in _prose(DOCS / 'training.md'), f'docs/training.md should say "{want}" (the records: {totals})'


# claims the records contradicted (the docs once made each): a page that makes one again fails here
RETIRED_CLAIMS = {
    r'recipes are (?:in )?fp32': "stages 2-5 of every tiny weight's record say --amp bf16",
    r'\bhub trajectory\b': 'the command is `python -m experiments.weights trajectory`',
    r'90\.92% teacher': 'the guided students name the 91.47% teacher (revision 49c410a)',
    r'\bDESIGN\.md\b': 'the repository has no DESIGN.md',
    r'give the (?:looped weights\' )?sha256': 'the cards name the looped weights by repository and revision',
    r'\bbf16 does not pay\b(?! on a CPU without native bf16)': 'bf16 autocast pays where the CPU has native bf16',
}


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_pages_do_not_make_retired_claims(page):
    text = _prose(page)
    found = {pattern: why for pattern, why in RETIRED_CLAIMS.items() if re.search(pattern, text, re.I)}
    assert not found, f'{_rel(page)} makes claims the records contradict: {found}'


def test_readme_and_testing_page_give_one_fast_tier_figure():
    tier = r'python -m pytest -m "not slow"`[^.]*?(\d+ min \d+ s)'
    figures = {_rel(p): re.findall(tier, _prose(p)) for p in (README, DOCS / 'testing.md')}
    assert all(len(f) == 1 for f in figures.values()) and len({f[0] for f in figures.values()}) == 1, figures


def test_testing_page_quotes_its_full_run_log():
    """docs/testing.md's full-suite figure and slowest tests are those of the run log it names."""
    text = (DOCS / 'testing.md').read_text()
    log = (REPO_ROOT / re.search(r'its output: `(results/tests/full_run_[\d-]+\.log)`', text).group(1)).read_text()
    minutes, seconds = map(int, re.search(r'\*\*(\d+) min (\d+) s\*\* for', text).groups())
    wall = float(re.search(r' in ([\d.]+)s \(', log.strip().splitlines()[-1]).group(1))
    assert round(wall) == 60 * minutes + seconds, (minutes, seconds, wall)
    slowest = [line for line in log.splitlines() if re.match(r'[\d.]+s call ', line)][:30]
    assert len(slowest) == 30 and '\n'.join(slowest) in text


# a speed or memory ratio has one reference run: the pages that quote one take it from the page that measures it
RATIO_SOURCES = {'models.md': 'benchmark.md', 'training.md': 'core.md', 'guide.md': 'core.md'}


@pytest.mark.parametrize('page,source', sorted(RATIO_SOURCES.items()))
def test_quoted_ratios_are_their_reference_runs(page, source):
    quoted = set(re.findall(r'\b\d+\.\d+x\b', _prose(DOCS / page)))
    measured = set(re.findall(r'\b\d+\.\d+x\b', (DOCS / source).read_text()))
    assert quoted <= measured, f'docs/{page} quotes {sorted(quoted - measured)}, which docs/{source} does not give'
