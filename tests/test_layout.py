"""The layout docs/layout.md promises: the library (``timm_odevit``) at most 3,500 non-blank lines, formatted as timm
is, and free of the tools and experiments, the tools (``timm_odevit_tools``) free of the experiments, and no import
circle anywhere.

Imports are read from the source (``ast``), function-level ones included, so a lazy import counts as much as one at
the top of a module."""
import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ('timm_odevit', 'timm_odevit_tools', 'experiments')
LIBRARY_MAX_LINES = 3500
# the names published cards and the README give: each forwards to the tools when run as a command
FORWARDERS = {'timm_odevit.__main__', 'timm_odevit.train', 'timm_odevit.hub'}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix('').parts)
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def import_graph(root: Path, packages=PACKAGES, unresolved: Optional[List[str]] = None) -> Dict[str, Set[str]]:
    """Module -> the modules of ``packages`` it imports (relative imports resolved; ``from a import b`` counts as an
    import of ``a.b`` where that is a module). An import of a module's own enclosing package is left out: Python runs
    the package's ``__init__`` first, and a package that re-exports its modules is no circle between ideas.
    ``unresolved``, when given, collects 'importer: module' for each import of a module of ``packages`` that does
    not exist (a lazy import left behind by a move fails only when its function runs)."""
    paths = {_module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob('*.py'))}
    graph = {}
    for name, path in paths.items():
        base = name.split('.') if path.name == '__init__.py' else name.split('.')[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = '.'.join(base[:len(base) - node.level + 1] + [node.module or ''] if node.level else
                                  [node.module]).rstrip('.')
                found.add(module)
                found.update(f'{module}.{a.name}' for a in node.names)
                if unresolved is not None and module.split('.')[0] in packages and module not in paths:
                    unresolved.append(f'{name}: {module}')
        graph[name] = {m for m in found if m in paths and m != name and not name.startswith(m + '.')}
    return graph


def import_circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of modules that import each
    other round a circle."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


@pytest.fixture(scope='module')
def graph():
    return import_graph(REPO_ROOT)


def test_no_import_circle(graph):
    assert import_circles(graph) == []


def test_the_circle_check_finds_a_circle(tmp_path):
    # the hub/table <-> study/guidance circle this layout removed, written small
    for rel, text in {'pkg/__init__.py': '', 'pkg/hub/__init__.py': '', 'pkg/study/__init__.py': '',
                      'pkg/hub/table.py': 'def f():\n    from ..study.guidance import G\n',
                      'pkg/study/guidance.py': 'from ..hub import table\nG = 1\n'}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert import_circles(import_graph(tmp_path, ('pkg',))) == [['pkg.hub.table', 'pkg.study.guidance']]


def test_every_import_of_a_project_module_resolves():
    unresolved: List[str] = []
    import_graph(REPO_ROOT, unresolved=unresolved)
    assert unresolved == []


def test_library_imports_neither_tools_nor_experiments(graph):
    bad = {name: sorted(m for m in deps if m.split('.')[0] != 'timm_odevit')
           for name, deps in graph.items() if name.split('.')[0] == 'timm_odevit' and name not in FORWARDERS}
    assert {k: v for k, v in bad.items() if v} == {}
    for name in FORWARDERS:  # a forwarder reaches the tools only to run them
        assert all(m.startswith('timm_odevit_tools.') for m in graph[name] if not m.startswith('timm_odevit.')), name


def test_tools_do_not_import_experiments(graph):
    bad = {name: sorted(m for m in deps if m.split('.')[0] == 'experiments')
           for name, deps in graph.items() if name.split('.')[0] == 'timm_odevit_tools'}
    assert {k: v for k, v in bad.items() if v} == {}


def test_library_is_at_most_3500_lines_of_code():
    """Non-blank lines, so formatting is free (two blank lines between top-level definitions, as timm) and only
    code and its documentation count."""
    counts = {str(p.relative_to(REPO_ROOT)): sum(1 for line in p.read_text().splitlines() if line.strip())
              for p in sorted((REPO_ROOT / 'timm_odevit').rglob('*.py'))}
    total = sum(counts.values())
    largest = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert total <= LIBRARY_MAX_LINES, f'the library has {total} non-blank lines (largest: {largest}): move tooling out'


def test_the_library_is_formatted_as_timm_is():
    """Two blank lines between top-level definitions and lines of at most 120 characters (pycodestyle's E30x,
    E501)."""
    pycodestyle = pytest.importorskip('pycodestyle')
    style = pycodestyle.StyleGuide(select=['E301', 'E302', 'E303', 'E305', 'E501'], max_line_length=120, quiet=True)
    report = style.check_files([str(p) for p in sorted((REPO_ROOT / 'timm_odevit').rglob('*.py'))])
    assert report.total_errors == 0, report.get_statistics()


@pytest.mark.parametrize('argv, says', [
    (['timm_odevit', '--no-demo', '--sizes', 'tiny'], '| `ssog_ode_tiny` | ssog | ode |'),
    (['timm_odevit.train', '--help'], 'usage: python -m timm_odevit_tools.train'),
    (['timm_odevit.hub', 'evaluate', '--help'], 'usage: python -m timm_odevit_tools.hub evaluate'),
])
def test_the_librarys_command_names_run_the_tools(argv, says, tmp_path):
    """``python -m timm_odevit`` (the README's main command) and the names published cards and their earlier revisions
    give (``timm_odevit.train``, ``timm_odevit.hub evaluate``) run the tools' commands, from any folder."""
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    r = subprocess.run([sys.executable, '-m', *argv], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(env, PYTHONPATH=str(REPO_ROOT)))
    assert r.returncode == 0 and says in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_in_process_tests_import_the_installed_package():
    """After a normal install (CI's) the tests import what pip installed, never the checkout's copy, so a module or
    file the wheel lacks fails a test; an editable install maps to the checkout by the developer's choice."""
    import json
    from importlib.metadata import distribution
    import timm_odevit
    import timm_odevit_tools
    direct = distribution('timm_odevit').read_text('direct_url.json')
    editable = bool(direct) and json.loads(direct).get('dir_info', {}).get('editable', False)
    where = [Path(m.__file__).resolve() for m in (timm_odevit, timm_odevit_tools)]
    # CI's venv lies inside the checkout (.ci/venv), so what matters is the source folder, not the repository root.
    checkout = [REPO_ROOT / 'timm_odevit' / '__init__.py', REPO_ROOT / 'timm_odevit_tools' / '__init__.py']
    if editable:
        assert where == checkout, where
    else:
        assert not set(where) & set(checkout), f'the checkout was imported: {where}'
