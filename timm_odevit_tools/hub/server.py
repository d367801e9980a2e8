"""A local Hugging Face Hub mirror over a folder of repos: what ``HF_ENDPOINT`` points at on an air-gapped machine.

``python -m timm_odevit_tools.hub serve --root weights --port 8765`` then ``HF_ENDPOINT=http://127.0.0.1:8765``.
The folder holds ``<repo>/`` directories (``weights/<arch>.<tag>/``) and ``MANIFEST.json``; each is served as
``<org>/<repo>``. Routes (the Hub's download protocol, as huggingface_hub's ``hf_hub_download`` uses it):

- ``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}``: ``X-Repo-Commit`` (40 hex), ``ETag`` (the file's sha256),
  ``Content-Length``, ``Accept-Ranges``; GET honours ``Range: bytes=a-[b]``. ``main`` is the folder as it is; its
  commit is the git commit that published it (``revisions.published_revision``) where the root lies in a checkout
  and the folder holds no uncommitted change, else an id derived from the manifest. Any other revision (a commit,
  a tag, a branch of the checkout) is served from git history, each file checked against that commit's manifest
  (``revisions.files_at``): a weight trained again leaves the version before loadable at its revision.
- ``GET /api/models/{org}/{repo}[/revision/{revision}]``: repo info with ``sha`` and ``siblings``
  (``snapshot_download``).
- 404 with ``X-Error-Code``: ``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound`` (the Hub's codes, which
  huggingface_hub maps to its error classes). Every file of a repo failing its checks (see ``verify.py``) is
  refused with ``REFUSED_STATUS`` and an ``X-Error-Message`` naming the bad file and the fix, so no client caches any
  of it. huggingface_hub retries 408/429/5xx for about half a minute and turns most other errors into a generic
  "check your connection"; a 401 is neither retried nor rewrapped, so the user sees the refusal at once, with the
  mirror's reason as the last line of the error.
- Bytes are served from a verified private copy of each repo (a snapshot, hashed while copied), rebuilt when a file
  or the manifest changes: a file rewritten in place while a client downloads it, or changed without a new mtime,
  never reaches a client; every byte sent hashes to the manifest's sha256.
- Malformed requests (a NUL or undecodable byte in the path, a Range that does not parse or has absurd numbers) get
  400 or 416 with the reason, never a dropped connection.

Only the standard library (``http.server``, threaded); binds to loopback unless told another interface.
"""
import errno
import hashlib
import ipaddress
import itertools
import json
import logging
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import unquote, urlsplit

from timm_odevit.models.pretrained import local_weights_roots
from . import CONFIG_FILE, MANIFEST_FILE, ORG
from .revisions import RevisionError, files_at, published_revision, resolve_revision
from .verify import EXPORT_FIX, RepoError, load_manifest, sha256_file, verify_repo

__all__ = ['HubMirror', 'serve', 'REFUSED_STATUS']

# the longest refusal reason a response carries (its X-Error-Message header line)
MAX_REASON = 1000
_REFUSAL = 'The local Hub mirror refuses {repo}: it failed its checks, so nothing of it is served.'


_logger = logging.getLogger(__name__)

_NAME = re.compile(r'^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$')
# at most 18 digits per bound: every file size fits, and int() never meets a 5,000-digit number
_RANGE = re.compile(r'bytes=(\d{1,18})-(\d{0,18})')
_CHUNK = 1 << 16
MAX_PATH = 1024
# the status of a refused (broken) repo: one huggingface_hub neither retries nor hides behind "check your connection"
REFUSED_STATUS = 401


def _header_safe(text: str) -> str:
    """One header line: control characters (CR, LF, NUL...) become spaces, anything outside Latin-1 an escape."""
    text = re.sub(r'[\x00-\x1f\x7f]+', ' ', text)
    return text.encode('latin-1', 'backslashreplace').decode('latin-1')


class _Handler(BaseHTTPRequestHandler):
    server: '_Server'
    protocol_version = 'HTTP/1.1'
    # a stalled client cannot hold a thread forever
    timeout = 30

    def log_message(self, fmt: str, *args: Any) -> None:
        _logger.debug('%s %s', self.address_string(), fmt % args)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _send(self, status: int, headers: Dict[str, str], body: bytes = b'', head: bool = False) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if 'Content-Length' not in headers:
            self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _error(self, status: int, code: Optional[str], message: str, head: bool,
               extra: Optional[Dict[str, str]] = None) -> None:
        body = json.dumps({'error': message}).encode()
        headers = {'Content-Type': 'application/json', 'X-Error-Message': _header_safe(message)}
        if code:
            headers['X-Error-Code'] = code
        headers.update(extra or {})
        self._send(status, headers, body, head)

    def _route(self, head: bool) -> None:
        status = 500
        try:
            status = self._dispatch(head)
        except (BrokenPipeError, ConnectionResetError):
            status = 499
        except Exception as e:  # a bug must still answer: a dropped connection makes clients retry and guess
            _logger.exception('mirror: %s %s failed', self.command, self.path)
            try:
                self._error(500, None, f'Internal mirror error: {type(e).__name__}: {e}', head)
            except OSError:
                pass
        finally:
            self.server.record(self.command, self.path, status)

    def _dispatch(self, head: bool) -> int:
        try:
            path = unquote(urlsplit(self.path).path, errors='strict')
        except (UnicodeDecodeError, ValueError):
            self._error(400, None, 'Request path is not valid percent-encoded UTF-8.', head)
            return 400
        if len(path) > MAX_PATH:
            self._error(414, None, 'Request path too long.', head)
            return 414
        if re.search(r'[\x00-\x1f\x7f]', path):
            self._error(400, None, 'Request path holds a control character (e.g. %00).', head)
            return 400
        parts = [p for p in path.split('/') if p]
        if len(parts) >= 5 and parts[2] == 'resolve':
            return self._resolve(parts[0], parts[1], parts[3], '/'.join(parts[4:]), head)
        if len(parts) >= 4 and parts[:2] == ['api', 'models']:
            rev = parts[5] if len(parts) >= 6 and parts[4] == 'revision' else 'main'
            return self._info(parts[2], parts[3], rev, head)
        self._error(404, None, f'No such route: {path}. This mirror serves /{{org}}/{{repo}}/resolve/{{rev}}/{{file}}.',
                    head)
        return 404

    def _repo(self, org: str, repo: str, head: bool) -> Optional[Path]:
        srv = self.server
        if org != srv.org:
            self._error(404, 'RepoNotFound', f'Repository {org}/{repo} not found: this mirror serves org {srv.org}; '
                                             f'ask for {srv.org}/{repo}, or restart the mirror with --org {org}.', head)
            return None
        if not _NAME.match(repo) or not (srv.root / repo).is_dir():
            self._error(404, 'RepoNotFound', f'Repository {org}/{repo} not found in {srv.root}. Export it there with '
                                             f'`{EXPORT_FIX} --root {srv.root}`.', head)
            return None
        return srv.root / repo

    def _repo_at(self, org: str, repo: str, rev: str, head: bool) -> Optional['_Snapshot']:
        """The repo's snapshot when the repo and revision exist, else None after sending the Hub's 404."""
        if self._repo(org, repo, head) is None:
            return None
        snap = self.server.snapshot(repo)
        if rev in ('main', snap.commit):
            return snap
        try:
            return self.server.revision_snapshot(repo, rev)
        except RevisionError as e:
            self._error(404, 'RevisionNotFound', f'Revision {rev} not found for {self.server.org}/{repo}: {e} main '
                                                 f'is {snap.commit}.', head, {'X-Repo-Commit': snap.commit})
            return None

    def _resolve(self, org: str, repo: str, rev: str, rel: str, head: bool) -> int:
        snap = self._repo_at(org, repo, rev, head)
        if snap is None:
            return 404
        commit = snap.commit
        real = self.server.root / repo / rel
        if '..' in rel.split('/') or (self.server.root / repo).resolve() not in real.resolve().parents:
            self._error(404, 'EntryNotFound', f'{rel} not found in {org}/{repo}.', head, {'X-Repo-Commit': commit})
            return 404
        problem = snap.problem(real)
        if problem is not None:
            self._error(REFUSED_STATUS, None, f'{_REFUSAL.format(repo=f"{org}/{repo}")} {problem}', head,
                        {'X-Repo-Commit': commit})
            return REFUSED_STATUS
        target = snap.folder / rel
        if not target.is_file():
            self._error(404, 'EntryNotFound', f'{rel} not found in {org}/{repo}.', head, {'X-Repo-Commit': commit})
            return 404
        sha = snap.sha256(rel)
        size = target.stat().st_size
        start, end = 0, size - 1
        status = 200
        rng = self.headers.get('Range')
        m = _RANGE.fullmatch(rng.strip()) if rng else None
        if rng and not m:
            self._error(416, None, f'Range {rng[:40]!r} not understood: this mirror serves one range, bytes=a-[b].',
                        head, {'Content-Range': f'bytes */{size}'})
            return 416
        if m and not head:
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            if start > end:
                self._error(416, None, f'Range {rng} outside 0-{size - 1}.', head, {'Content-Range': f'bytes */{size}'})
                return 416
            status = 206
        headers = {
            'Content-Type': 'application/octet-stream', 'Content-Length': str(end - start + 1),
            'ETag': f'"{sha}"', 'X-Repo-Commit': commit, 'Accept-Ranges': 'bytes',
        }
        if status == 206:
            headers['Content-Range'] = f'bytes {start}-{end}/{size}'
        self._send(status, headers, head=True)
        if not head:
            with open(target, 'rb') as f:
                f.seek(start)
                left = end - start + 1
                # bounded: at most size / _CHUNK iterations, and stops on a short read
                while left > 0:
                    block = f.read(min(_CHUNK, left))
                    if not block:
                        break
                    self.wfile.write(block)
                    left -= len(block)
        return status

    def _info(self, org: str, repo: str, rev: str, head: bool) -> int:
        snap = self._repo_at(org, repo, rev, head)
        if snap is None:
            return 404
        files = sorted(p.relative_to(snap.folder).as_posix() for p in snap.folder.rglob('*') if p.is_file())
        body = json.dumps({'id': f'{org}/{repo}', 'modelId': f'{org}/{repo}', 'sha': snap.commit, 'private': False,
                           'library_name': 'timm', 'siblings': [{'rfilename': f} for f in files]}).encode()
        self._send(200, {'Content-Type': 'application/json', 'X-Repo-Commit': snap.commit}, body, head)
        return 200


@dataclass(frozen=True)
class _Snapshot:
    """What the mirror serves of one repo: a private copy whose every byte hashed to the manifest's sha256."""
    folder: Path                      # the private copy (the repo folder itself when verification is off)
    files: Dict[str, Dict[str, Any]]  # file -> its manifest entry
    commit: str
    errors: Dict[Path, RepoError]     # by file in the real folder; non-empty: the repo is refused whole

    def problem(self, target: Path) -> Optional[str]:
        """Why ``target`` must not be served: any problem of its repo, the target's own first.

        A broken repo is refused whole: timm falls back from model.safetensors to pytorch_model.bin when the first
        fails, so refusing one file only would hide the reason behind a later 'not found'; and a client should not
        cache half of an inconsistent repo either.
        """
        if not self.errors:
            return None
        first, *rest = sorted(self.errors.values(), key=lambda e: e.path != target)
        more = (f' ({len(rest)} more problem{"s" if len(rest) > 1 else ""} in this repo: '
                "`python -m timm_odevit_tools.hub verify --root <the mirror's folder>` lists them)") if rest else ''
        # one header line a client takes whole (proxies and clients cut header lines at a few KiB): the file named
        # by its repo folder and name, not by the mirror's whole path
        reason = str(first).replace(str(first.path), (Path(first.path.parent.name) / first.path.name).as_posix(), 1)
        if len(reason) + len(more) > MAX_REASON:
            reason = reason[:MAX_REASON - len(more) - 3] + '...'
        return reason + more

    def sha256(self, rel: str) -> str:
        entry = self.files.get(rel)
        return entry['sha256'] if entry is not None else sha256_file(self.folder / rel)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # bounded backlog; each request thread has a socket timeout (_Handler.timeout)
    request_queue_size = 32

    def __init__(self, addr: Tuple[str, int], root: Path, org: str, verify: bool) -> None:
        # what server_close needs first: socketserver calls it when binding fails
        self._store = tempfile.TemporaryDirectory(prefix='timm_odevit_mirror_')
        super().__init__(addr, _Handler)
        self.root = Path(root)
        self.org = org
        self.verify = verify
        self.log: List[Tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._snapshots: Dict[str, Tuple[Any, _Snapshot]] = {}
        self._revisions: Dict[Tuple[str, str], _Snapshot] = {}  # (repo, commit): a revision never changes
        # snapshots are never rewritten or deleted while the server runs: a download in flight keeps its bytes
        self._copies = itertools.count()

    def server_close(self) -> None:
        super().server_close()
        self._store.cleanup()

    def record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.log.append((method, path, status))
        _logger.info('%s %s %d', method, path, status)

    def _state(self, repo: str) -> Tuple[Any, ...]:
        files = sorted((p.as_posix(), p.stat().st_mtime_ns, p.stat().st_size)
                       for p in (self.root / repo).rglob('*') if p.is_file())
        m = self.root / MANIFEST_FILE
        return (tuple(files), m.stat().st_mtime_ns if m.is_file() else None)

    def snapshot(self, repo: str) -> _Snapshot:
        """The repo as served, rebuilt only when a file or the manifest changed (by mtime or size).

        A change the state misses (same size, old mtime) leaves the previous verified copy in service, so the
        mirror never sends a byte that does not hash to the manifest's sha256.
        """
        state = self._state(repo)
        with self._lock:
            hit = self._snapshots.get(repo)
        if hit is not None and hit[0] == state:
            return hit[1]
        with self._build_lock:
            with self._lock:
                hit = self._snapshots.get(repo)
            if hit is not None and hit[0] == state:
                return hit[1]
            snap = self._build(repo)
            with self._lock:
                self._snapshots[repo] = (state, snap)
            return snap

    def revision_snapshot(self, repo: str, revision: str) -> _Snapshot:
        """The repo as git commit ``revision`` published it (RevisionError when the checkout lacks it, or its files
        fail that commit's manifest)."""
        commit = resolve_revision(self.root, revision)
        with self._build_lock:
            snap = self._revisions.get((repo, commit))
            if snap is None:
                folder = Path(self._store.name) / str(next(self._copies)) / repo
                files = {}
                for rel, data in files_at(self.root, repo, commit).items():
                    (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                    (folder / rel).write_bytes(data)
                    files[rel] = {'sha256': hashlib.sha256(data).hexdigest(), 'size': len(data)}
                snap = self._revisions[repo, commit] = _Snapshot(folder, files, commit, {})
        return snap

    def _build(self, repo: str) -> _Snapshot:
        try:
            manifest: Optional[Dict[str, Any]] = load_manifest(self.root)
            errors: Dict[Path, RepoError] = {}
        except RepoError as e:
            manifest, errors = None, {e.path: e}
        files = {k: v for k, v in (manifest or {}).get('files', {}).items() if k.startswith(f'{repo}/')}
        # the commit that published the folder; outside git or with uncommitted files, a stable 40-hex id per repo:
        # sha1 over its manifest entries (changes when a file does)
        basis = files or {p.as_posix(): p.stat().st_size for p in (self.root / repo).rglob('*') if p.is_file()}
        commit = published_revision(self.root / repo) or \
            hashlib.sha1(json.dumps(basis, sort_keys=True).encode()).hexdigest()
        own = {k[len(repo) + 1:]: v for k, v in files.items()}
        if not self.verify:
            return _Snapshot(self.root / repo, own, commit, {})
        if manifest is not None:
            errors = {e.path: e for e in verify_repo(self.root, repo, manifest)}
        if errors:
            return _Snapshot(self.root / repo, own, commit, errors)
        folder = Path(self._store.name) / str(next(self._copies)) / repo
        for rel, entry in own.items():
            src, dst = self.root / repo / rel, folder / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            # hash what is copied: a file rewritten between the checks and the copy is caught here
            if _copy_hashed(src, dst) != entry['sha256']:
                errors[src] = RepoError(src, 'changed while the mirror copied it (an export in progress?); '
                                             'retry when the export has finished.')
        return _Snapshot(folder, own, commit, errors)


def _copy_hashed(src: Path, dst: Path) -> str:
    h = hashlib.sha256()
    with open(src, 'rb') as fin, open(dst, 'wb') as fout:
        for block in iter(lambda: fin.read(1 << 20), b''):
            h.update(block)
            fout.write(block)
    return h.hexdigest()


class HubMirror:
    """The mirror as an object: ``with HubMirror('weights') as m: ... m.url ... m.log``.

    Args:
        root: Folder of repo folders plus MANIFEST.json.
        port: TCP port on ``host`` (0: a free one).
        host: The address to listen on: loopback (the default), or an interface a cluster reaches (warned).
        org: Organisation the repos are served under.
        verify: Refuse files failing the manifest/config/weights checks (on by default).
    """

    def __init__(self, root: str = 'weights', port: int = 0, host: str = '127.0.0.1', org: str = ORG,
                 verify: bool = True) -> None:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            raise ValueError(f'--host {host!r} is not an IP address: give 127.0.0.1 (this machine only) or the '
                             'address of the interface a cluster reaches this machine on.') from None
        if not loopback:
            _logger.warning('Serving on %s: every machine that reaches this interface can download these weights '
                            '(read-only, no authentication). Use --host 127.0.0.1 to serve this machine only.', host)
        if not Path(root).is_dir():
            raise FileNotFoundError(f'{root} is not a folder of Hub repos (e.g. weights/).')
        if not (Path(root) / MANIFEST_FILE).is_file() and not any(Path(root).glob(f'*/{CONFIG_FILE}')):
            raise FileNotFoundError(f'{root} holds no Hub repos (no {MANIFEST_FILE}, no <repo>/{CONFIG_FILE}): give '
                                    'the folder that holds the <arch>.<tag>/ folders, e.g. weights/.')
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f'Port {port!r} is not a TCP port: give one in 0-65535 (0: a free one).')
        try:
            self._server = _Server((host, port), Path(root), org, verify)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(f'Port {port} on {host} is in use (another mirror?): stop it, or choose another with '
                              '--port (0: a free one).') from None
            raise OSError(f'The mirror cannot listen on {host}:{port}: {e.strerror or e}.') from None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f'http://{host}:{port}'

    @property
    def log(self) -> List[Tuple[str, str, int]]:
        """(method, path, status) of every request so far."""
        with self._server._lock:
            return list(self._server.log)

    def clear_log(self) -> None:
        with self._server._lock:
            self._server.log.clear()

    def start(self) -> 'HubMirror':
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={'poll_interval': 0.1},
                                        daemon=True, name='timm-odevit-hub-mirror')
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> 'HubMirror':
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def default_serve_root() -> Path:
    """What ``serve`` serves without ``--root``: ``./weights`` where it is a folder of repos, else the weights this
    install carries (a checkout's ``weights/``, or the default model's bundled with a wheel)."""
    here = Path('weights')
    if (here / MANIFEST_FILE).is_file():
        return here
    roots = local_weights_roots()
    if not roots:
        raise FileNotFoundError('No folder of Hub repos here (./weights) and none installed with timm_odevit: give '
                                'one with --root.')
    return roots[0]


def serve(root: str = 'weights', port: int = 8765, host: str = '127.0.0.1', org: str = ORG,
          verify: bool = True, duration: Optional[float] = None) -> None:
    """Serve in the foreground until Ctrl-C (or ``duration`` seconds), printing the HF_ENDPOINT to use."""
    mirror = HubMirror(root, port, host, org, verify).start()
    print(f'Serving {root} as {org}/<repo> at {mirror.url}\n  export HF_ENDPOINT={mirror.url}', flush=True)
    try:
        deadline = None if duration is None else time.monotonic() + duration
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        mirror.stop()
