"""Integrity of a folder of Hub repos: the manifest (sha256 and size of every file) and per-repo checks.

A repo passes when every file matches the manifest, ``config.json`` parses and names a registered architecture,
``model.safetensors`` has a complete header whose tensor names and shapes are those of that architecture built from
``config.json``, and ``record.json`` parses and names the folder and that architecture. The mirror refuses to serve
a file that fails, so a client's cache never receives it.
"""
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import CONFIG_FILE, MANIFEST_FILE, RECORD_FILE, WEIGHTS_FILE

__all__ = ['RepoError', 'sha256_file', 'build_manifest', 'write_manifest', 'load_manifest',
           'verify_repo', 'verify_root']

EXPORT_FIX = 'python -m timm_odevit_tools.hub export RUN/last.pth.tar --tag TAG'  # RUN: the training run's folder
MANIFEST_FIX = 'python -m timm_odevit_tools.hub manifest --root {root}'


class RepoError(ValueError):
    """A file of a weights repo is missing, corrupted or inconsistent. ``path`` names the file; the message says
    what to do."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f'{path}: {message}')
        self.path = Path(path)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(chunk), b''):
            h.update(block)
    return h.hexdigest()


def _repo_dirs(root: Path) -> List[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith('.'))


def build_manifest(root: Path) -> Dict[str, Any]:
    """sha256 and size of every file of every repo folder under ``root`` (keys: ``<repo>/<file>``)."""
    root = Path(root)
    files = {}
    for repo in _repo_dirs(root):
        for f in sorted(repo.rglob('*')):
            if f.is_file():
                files[f.relative_to(root).as_posix()] = {'sha256': sha256_file(f), 'size': f.stat().st_size}
    return {'format': 1, 'files': files}


def write_manifest(root: Path) -> Path:
    """(Re)write ``root/MANIFEST.json`` from the files as they are now."""
    path = Path(root) / MANIFEST_FILE
    tmp = path.with_name(f'{path.name}.{os.getpid()}.tmp')
    tmp.write_text(json.dumps(build_manifest(root), indent=2, sort_keys=True) + '\n')
    os.replace(tmp, path)
    return path


def load_manifest(root: Path) -> Dict[str, Any]:
    """``root/MANIFEST.json``, checked to be ``{"files": {"<repo>/<file>": {"sha256": hex, "size": int}}}``."""
    path = Path(root) / MANIFEST_FILE
    fix = f'restore it from git or rewrite it with `{MANIFEST_FIX.format(root=root)}`'
    if not path.is_file():
        raise RepoError(path, f'no manifest; write it with `{MANIFEST_FIX.format(root=root)}` after checking the '
                              'files.')
    try:
        manifest = json.loads(path.read_text(encoding='utf-8'))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RepoError(path, f'not valid JSON ({e}); {fix}.') from e
    files = manifest.get('files') if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise RepoError(path, f'is valid JSON but not a manifest (expected an object with a "files" object, got '
                              f'{type(manifest).__name__}); {fix}.')
    for rel, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get('sha256'), str)
                and isinstance(entry.get('size'), int) and not isinstance(entry.get('size'), bool)):
            raise RepoError(path, f'entry {rel!r} is not {{"sha256": str, "size": int}} (got {entry!r:.80}); {fix}.')
    return manifest


def check_file(root: Path, rel: str, manifest: Dict[str, Any]) -> None:
    """Size and sha256 of ``root/rel`` against the manifest."""
    path = Path(root) / rel
    entry = manifest.get('files', {}).get(rel)
    if entry is None:
        raise RepoError(path, f'not listed in {MANIFEST_FILE}; export weights with `{EXPORT_FIX}` (it updates the '
                              f'manifest) or run `{MANIFEST_FIX.format(root=root)}`.')
    size = path.stat().st_size
    if size != entry['size']:
        raise RepoError(path, f'size {size} bytes but {MANIFEST_FILE} records {entry["size"]} (truncated or '
                              f'replaced); restore the file (git checkout / re-download) or re-export it with '
                              f'`{EXPORT_FIX}`.')
    digest = sha256_file(path)
    if digest != entry['sha256']:
        raise RepoError(path, f'sha256 {digest} does not match {MANIFEST_FILE} ({entry["sha256"]}); the file is '
                              f'corrupted or was changed: restore it or re-export it with `{EXPORT_FIX}`.')


def read_config(path: Path) -> Dict[str, Any]:
    try:
        cfg = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RepoError(path, f'not valid JSON ({e}); re-export with `{EXPORT_FIX}`.') from e
    if not isinstance(cfg, dict) or 'architecture' not in cfg:
        raise RepoError(path, f"has no 'architecture' key; it must be written by timm's save_for_hf "
                              f'(`{EXPORT_FIX}`).')
    return cfg


def check_architecture(cfg_path: Path, cfg: Dict[str, Any]) -> None:
    import timm
    arch = cfg['architecture']
    if not timm.is_model(arch):
        raise RepoError(cfg_path, f"names architecture {arch!r}, which no imported package registers with timm. "
                                  f"Fix 'architecture' in {cfg_path.name}, or install/import the package that "
                                  f'registers it (ours: `import timm_odevit`).')


def safetensors_shapes(path: Path) -> Dict[str, Tuple[int, ...]]:
    """Tensor names and shapes from the header alone; a truncated or corrupted file raises RepoError."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework='pt') as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise RepoError(path, f'not a complete safetensors file ({e}); restore it or re-export with '
                              f'`{EXPORT_FIX}`.') from e


def expected_shapes(cfg: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """State-dict shapes of the model ``config.json`` describes, built on the meta device (no memory, no init)."""
    import timm
    kwargs = dict(cfg.get('model_args', {}))
    kwargs.setdefault('num_classes', cfg.get('num_classes', 1000))
    pcfg = cfg.get('pretrained_cfg', {})
    if 'input_size' in pcfg:
        kwargs.setdefault('in_chans', pcfg['input_size'][0])
    model = timm.create_model(cfg['architecture'], pretrained=False, device='meta', **kwargs)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_weights_match(weights: Path, cfg_path: Path, cfg: Dict[str, Any]) -> None:
    got = safetensors_shapes(weights)
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if missing or extra or wrong:
        detail = '; '.join(s for s in (
            f'missing {missing[:3]}' + ('...' if len(missing) > 3 else '') if missing else '',
            f'unexpected {extra[:3]}' + ('...' if len(extra) > 3 else '') if extra else '',
            f'shape of {wrong[0]} is {got[wrong[0]]}, expected {want[wrong[0]]}' if wrong else '') if s)
        raise RepoError(weights, f'does not hold weights of {cfg["architecture"]!r} as {cfg_path.name} describes '
                                 f'({detail}); these are weights of another architecture or configuration: export '
                                 f'the right checkpoint with `{EXPORT_FIX}`, or fix {cfg_path.name}.')


def check_record(path: Path, repo: str, cfg: Optional[Dict[str, Any]]) -> None:
    """``record.json`` (``record.py``) parses and describes this folder: its name, and its config's architecture."""
    fix = f'restore it (git checkout) or re-render it with `python -m timm_odevit_tools.hub remeasure {path.parent}`'
    try:
        record = json.loads(path.read_text(encoding='utf-8'))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RepoError(path, f'not valid JSON ({e}); {fix}.') from e
    named = record.get('weights') if isinstance(record, dict) else None
    arch = record.get('architecture') if isinstance(record, dict) else None
    if named != repo or (cfg is not None and arch != cfg['architecture']):
        raise RepoError(path, f'describes {named!r} ({arch!r}), not this folder {repo!r}'
                              + (f" ({cfg['architecture']!r})" if cfg else '') + f': another folder\'s record; {fix}.')


def verify_repo(root: Path, repo: str, manifest: Optional[Dict[str, Any]] = None) -> List[RepoError]:
    """Every problem of one repo folder ``root/repo`` (empty list: it is sound). Never raises RepoError."""
    root = Path(root)
    repo_dir = root / repo
    errors: List[RepoError] = []
    try:
        manifest = manifest if manifest is not None else load_manifest(root)
    except RepoError as e:
        return [e]
    for f in sorted(repo_dir.rglob('*')):
        if f.is_file():
            try:
                check_file(root, f.relative_to(root).as_posix(), manifest)
            except RepoError as e:
                errors.append(e)
    for rel in manifest.get('files', {}):
        if rel.startswith(f'{repo}/') and not (root / rel).is_file():
            errors.append(RepoError(root / rel, f'listed in {MANIFEST_FILE} but missing; restore it or re-export '
                                                f'with `{EXPORT_FIX}`.'))
    cfg_path, weights, record = repo_dir / CONFIG_FILE, repo_dir / WEIGHTS_FILE, repo_dir / RECORD_FILE
    bad = {e.path for e in errors}
    cfg = None
    if cfg_path.is_file() and cfg_path not in bad:
        try:
            cfg = read_config(cfg_path)
            check_architecture(cfg_path, cfg)
            if weights.is_file() and weights not in bad:
                check_weights_match(weights, cfg_path, cfg)
        except RepoError as e:
            errors.append(e)
    elif weights.is_file() and weights not in bad:
        try:
            safetensors_shapes(weights)
        except RepoError as e:
            errors.append(e)
    if record.is_file() and record not in bad:
        try:
            check_record(record, repo, cfg)
        except RepoError as e:
            errors.append(e)
    return errors


def verify_root(root: Path) -> Dict[str, List[RepoError]]:
    """``verify_repo`` for every repo folder under ``root``."""
    root = Path(root)
    try:
        manifest = load_manifest(root)
    except RepoError as e:
        return {'': [e]}
    return {d.name: verify_repo(root, d.name, manifest) for d in _repo_dirs(root)}
