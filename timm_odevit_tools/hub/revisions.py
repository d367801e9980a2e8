"""Published versions: a repo's revisions are the commits of the git checkout that holds its folder.

The Hub keeps every push of a repo as a commit and serves any of them (``resolve/<commit>/<file>``; timm loads one as
``hf-hub:<org>/<repo>@<revision>``). Here the checkout's git history is that store: a weight trained again is
exported over its folder and committed, and the version before stays loadable at the commit that published it. A
record names the weights a stage started from and its teacher by repo and revision (``weights_source``); the mirror
serves any revision of a repo from history, each file checked against that commit's ``MANIFEST.json``
(``files_at``). Weights that were never committed in a published folder (a training checkpoint, a folder with
uncommitted changes) have no revision: a record names them by sha256, the only identity they have.
"""
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import MANIFEST_FILE, ORG, RECORD_FILE, WEIGHTS_FILE
from .verify import sha256_file

__all__ = ['RevisionError', 'published_revision', 'check_replaceable', 'resolve_revision', 'files_at', 'revision_log',
           'weights_source', 'source_line']

# what a revision may be named by (a commit, a tag or a branch): never an option to git, never a path
_REVISION = re.compile(r'^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$')


class RevisionError(LookupError):
    """A revision of a repo is not in the checkout's history, or its files fail that commit's manifest."""


def _git(root: Path, *args: str, text: bool = True) -> Optional[Any]:
    """stdout of ``git -C root ARGS``, or None without git, outside a checkout, or when git fails."""
    if shutil.which('git') is None or not Path(root).is_dir():
        return None
    done = subprocess.run(['git', '-C', str(root), *args], capture_output=True, text=text)
    return done.stdout if done.returncode == 0 else None


def published_revision(folder: Path) -> Optional[str]:
    """The commit that published ``folder``'s files as they are now: the last commit that changed the folder when it
    holds no uncommitted change, else the newest commit whose folder held exactly these files (one checked out at an
    earlier revision, ``git checkout <revision> -- <folder>``, to export a run that started from it); None outside a
    git checkout or for files no commit of the folder held."""
    folder = Path(folder)
    status = _git(folder, 'status', '--porcelain', '--untracked-files=all', '--', '.')
    if status is None:
        return None
    if not status.strip():
        return (_git(folder, 'log', '-1', '--format=%H', '--', '.') or '').strip() or None
    files = {p.relative_to(folder).as_posix(): _blob(p) for p in folder.rglob('*') if p.is_file()}
    for commit in (_git(folder, 'log', '--format=%H', '--', '.') or '').split():
        listing = (_git(folder, 'ls-tree', '-r', commit, '--', '.') or '').splitlines()
        if {line.split('\t', 1)[1]: line.split()[2] for line in listing} == files:
            return commit
    return None


def _blob(path: Path) -> Optional[str]:
    """The id git gives ``path``'s bytes (what a commit holding the file names it by)."""
    return (_git(path.parent, 'hash-object', '--', path.name) or '').strip() or None


def check_replaceable(folder: Path) -> None:
    """Refuse to export new weights over a folder of a git checkout whose weights file no commit holds (modified or
    never committed): they would be lost, where a committed version stays loadable at its revision. Outside a
    checkout (or in a folder git ignores) there is no history to keep versions in, and nothing is refused."""
    weights = Path(folder) / WEIGHTS_FILE
    if weights.is_file() and _git(weights.parent, 'status', '--porcelain', '--', WEIGHTS_FILE) and \
            not _git(weights.parent, 'log', '-1', '--format=%H', f'--find-object={_blob(weights)}', '--', WEIGHTS_FILE):
        raise ValueError(f'{weights} holds weights that no commit keeps: exporting over them would lose them. Commit '
                         f'the folder (git add {folder} && git commit) to keep them loadable at their revision, or '
                         'delete it to discard them, then export again.')


def resolve_revision(root: Path, revision: str) -> str:
    """The full commit id ``revision`` (a commit, possibly abbreviated, a tag or a branch) names in the checkout
    holding ``root``; RevisionError when the checkout has no such commit."""
    if not _REVISION.match(revision):
        raise RevisionError(f'{revision!r} is not a revision name (a commit id, a tag or a branch).')
    commit = _git(root, 'rev-parse', '--verify', '--quiet', f'{revision}^{{commit}}')
    if not commit:
        shallow = (_git(root, 'rev-parse', '--is-shallow-repository') or '').strip() == 'true'
        where = 'this shallow clone (a clone without --depth holds every revision)' if shallow else \
            f'the git history of {root}'
        raise RevisionError(f'Revision {revision} is not in {where}; `python -m timm_odevit_tools.hub revisions '
                            f'{Path(root) / "<repo>"}` lists the revisions of a repo.')
    return commit.strip()


def files_at(root: Path, repo: str, revision: str) -> Dict[str, bytes]:
    """The files of ``root/repo`` as commit ``revision`` published them, each checked against that commit's
    ``root/MANIFEST.json`` (sha256 and size); RevisionError naming what is wrong when the commit has no such folder,
    no manifest, or a file that fails it."""
    commit = resolve_revision(root, revision)
    names = (_git(root, 'ls-tree', '-r', '--name-only', commit, '--', f'{repo}/') or '').split('\n')
    names = [n for n in names if n]
    if not names:
        raise RevisionError(f'{repo} has no files at revision {commit}: that commit predates it (`python -m '
                            f'timm_odevit_tools.hub revisions {Path(root) / repo}` lists its revisions).')
    manifest = _git(root, 'show', f'{commit}:./{MANIFEST_FILE}')
    try:
        entries = json.loads(manifest)['files'] if manifest else None
    except (ValueError, KeyError, TypeError):
        entries = None
    if not isinstance(entries, dict):
        raise RevisionError(f'Revision {commit} has no readable {MANIFEST_FILE} beside {repo}: nothing of it can be '
                            'checked, so nothing of it is served; ask for a later revision.')
    files = {}
    for name in names:
        rel = name[len(repo) + 1:]
        entry = entries.get(f'{repo}/{rel}')
        data = _git(root, 'show', f'{commit}:./{name}', text=False)
        if entry is None or data is None or len(data) != entry.get('size'):
            raise RevisionError(f'{repo}/{rel} at revision {commit} is not what that commit\'s {MANIFEST_FILE} lists: '
                                'the revision is inconsistent; ask for another.')
        if hashlib.sha256(data).hexdigest() != entry.get('sha256'):
            raise RevisionError(f'{repo}/{rel} at revision {commit} does not hash to its {MANIFEST_FILE} entry: the '
                                'revision is inconsistent; ask for another.')
        files[rel] = data
    return files


def revision_log(folder: Path) -> List[Dict[str, Any]]:
    """The revisions of a published folder, newest first: the commits that changed it (commit, date, subject, and
    whether they changed its weights or only its card, config or record); empty outside a git checkout."""
    fmt = ['--format=%H%x09%ad%x09%s', '--date=short']
    weights = set((_git(folder, 'log', '--format=%H', '--', WEIGHTS_FILE) or '').split())
    log = _git(folder, 'log', *fmt, '--', '.') or ''
    return [dict(zip(('commit', 'date', 'subject'), line.split('\t', 2)), weights=line[:40] in weights)
            for line in log.splitlines() if line]


def weights_source(path: str, loaded_sha256: Optional[str] = None) -> Dict[str, Any]:
    """How a record names weights a run loaded (the weights it started from, its teacher): the file of a published
    folder committed as it is now by ``{'weights': path, 'repo': folder name, 'revision': commit}``, anything else
    by ``{'weights': path, 'sha256': hex}``. ``loaded_sha256``: the hash the run recorded on loading the file; a file
    that has changed since is refused (the record would name other weights than those the run used)."""
    src = Path(path)
    if not src.is_file():
        raise FileNotFoundError(f'{path}: the run loaded these weights and they are not here: export from the folder '
                                'the run started in, with them in place, so that the card can name them.')
    digest = sha256_file(src)
    if loaded_sha256 and digest != loaded_sha256:
        raise ValueError(f'{path} changed after the run loaded it (sha256 {loaded_sha256} then, {digest} now): put '
                         'back the weights it loaded (`git checkout <revision> -- <folder>` for a published folder; '
                         '`python -m timm_odevit_tools.hub revisions <folder>` lists them) and export again.')
    if src.name == WEIGHTS_FILE and (src.parent / RECORD_FILE).is_file():
        revision = published_revision(src.parent)
        if revision is not None:
            return {'weights': path, 'repo': src.parent.name, 'revision': revision}
    return {'weights': path, 'sha256': digest}


def source_line(source: Dict[str, Any]) -> str:
    """A record's weights source as a card names it."""
    if source.get('revision'):
        return (f'`{source["weights"]}`, the published `{source["repo"]}` at revision {source["revision"]}, '
                f'`hf-hub:{ORG}/{source["repo"]}@{source["revision"]}`')
    return f'`{source["weights"]}`, sha256 {source["sha256"]}'
