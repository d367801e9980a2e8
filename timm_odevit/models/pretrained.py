"""Pretrained cfgs of the published weights (``weights/<arch>.<tag>/``), referenced from the models' default_cfgs,
and the one place the Hub organisation is named.

A tag is listed here only once its folder is committed under ``weights/`` (a test checks both directions).
"""
import contextlib
import hashlib
import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple


__all__ = ['ORG', 'hub_id', 'FMNIST_TAG', 'FMNIST_CFG', 'fmnist_input', 'fmnist_cfg', 'TAG_MODEL_ARGS',
           'tag_model_args', 'keep_untagged_default', 'pretrained_source', 'local_weights_roots', 'ENDPOINT_TIMEOUT',
           'unreadable_weights_message', 'route_hf_hub_configs', 'check_local_weights',
           'mark_published_architectures']

# the one place the Hub organisation is named; every published hf_hub_id is built from it by hub_id()
ORG = 'timm-odevit'
# the package folder setup.py copies the published weights into (hub/demo.py names it too: a test checks both)
BUNDLE_DIR = '_bundled'
# seconds a Hub endpoint other than huggingface.co gets to answer before pretrained=True gives up on it
ENDPOINT_TIMEOUT = 2.0
FASHION_MNIST_CLASSES = (
    'T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle boot')
# mean / std of the 60k training images scaled to [0, 1] (timm_odevit_tools.data.load_tensors(..., normalize=False))
FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)


def hub_id(arch: str, tag: str) -> str:
    """``'<ORG>/<arch>.<tag>'``: the Hub repository of one published weight."""
    return f'{ORG}/{arch}.{tag}'


FMNIST_TAG = 'fmnist'
# the Fashion-MNIST weights take 1 grey channel at 32 px, normalised with the training set's mean and std
FMNIST_CFG: Dict[str, Any] = dict(
    num_classes=10, input_size=(1, 32, 32), crop_pct=1.0, interpolation='bicubic',
    mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD, label_names=list(FASHION_MNIST_CLASSES),
)


def fmnist_input(img_size: Optional[int] = None) -> Dict[str, Any]:
    """FMNIST_CFG at another input size: what weights trained with ``--model-kwargs img_size=<n>`` expect (None:
    FMNIST_CFG's own 32 px)."""
    chans, height, _ = FMNIST_CFG['input_size']
    size = height if img_size is None else img_size
    return dict(FMNIST_CFG, input_size=(chans, size, size))


def fmnist_cfg(arch: str, tag: str = FMNIST_TAG, img_size: Optional[int] = None) -> Dict[str, Any]:
    """depth_vit_cfg overrides for ``<arch>.<tag>``: where the weights live and what they expect (grey images at
    ``img_size``, by default FMNIST_CFG's; a 224-px architecture trained at a smaller size names that size in its
    tag)."""
    return dict(fmnist_input(img_size), hf_hub_id=hub_id(arch, tag))


# Model kwargs a published weight was trained with beyond its architecture's defaults: a tag solves on the grid it
# learnt. Each folder's config.json carries the same ``model_args`` (a test checks both), which timm's hf-hub: and
# local-dir: routes apply; create_depth_vit applies these to a tag asked for by name.
TAG_MODEL_ARGS: Dict[str, Dict[str, Any]] = {
    'odevit_tiny_patch4_32.fmnist': dict(ode_steps=23),
    'odevit_tiny_patch4_32.fmnist_distilled': dict(ode_steps=23),
    'ssog_ode_tiny_patch4_32.fmnist': dict(ode_steps=23),
    'ssog_ode_tiny_patch4_32.fmnist_distilled': dict(ode_steps=23),
}


def tag_model_args(variant: str, tag: Optional[str]) -> Dict[str, Any]:
    """The model kwargs ``<variant>.<tag>`` was trained with beyond the architecture's defaults (empty when none)."""
    return dict(TAG_MODEL_ARGS.get(f'{variant}.{tag}', {})) if tag else {}


def keep_untagged_default(default_cfgs: Dict[str, Any]) -> Dict[str, Any]:
    """Make the untagged cfg the default again for archs that gained a published tag.

    timm's generate_default_cfgs promotes the first tag with weights to the default, which would silently turn
    ``create_model('ssog_ode_tiny_patch4_32')`` into a 1-channel, 10-class model; our defaults stay 3-channel,
    1000-class, and the weights are asked for by name (``'<arch>.fmnist'``).
    """
    for dc in default_cfgs.values():
        if '' in dc.tags and dc.tags[0] != '':
            dc.tags.remove('')
            dc.tags.appendleft('')
    return default_cfgs


def local_weights_roots() -> List[Path]:
    """Folders of published repos (``<arch>.<tag>/`` plus ``MANIFEST.json``) this install carries: the weights bundled
    with the package (a wheel carries every published weight), and a checkout's ``weights/``."""
    package = Path(__file__).resolve().parents[1]
    candidates = (package / BUNDLE_DIR / 'weights', package.parent / 'weights')
    return [d for d in candidates if (d / 'MANIFEST.json').is_file()]


def _local_repo(hf_hub_id: str) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """(folder, manifest entries) of a published repo this install carries, or None."""
    repo = hf_hub_id.split('/', 1)[1]
    for root in local_weights_roots():
        files = json.loads((root / 'MANIFEST.json').read_text()).get('files', {})
        own = {k: v for k, v in files.items() if k.startswith(f'{repo}/')}
        if own and all((root / k).is_file() for k in own):
            return root / repo, own
    return None


def _seed_hub_cache(hf_hub_id: str, folder: Path, entries: Dict[str, Any]) -> Path:
    """Copy a local repo into the Hugging Face cache as huggingface_hub lays out a download (snapshot files, then
    ``refs/main``, so an interrupted copy is never a revision), under an id derived from the manifest's entries.
    Returns the snapshot folder."""
    from huggingface_hub import constants
    commit = hashlib.sha1(json.dumps(entries, sort_keys=True).encode()).hexdigest()
    org, name = hf_hub_id.split('/', 1)
    repo_cache = Path(constants.HF_HUB_CACHE) / f'models--{org}--{name}'
    snapshot = repo_cache / 'snapshots' / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for key, entry in entries.items():
        target = snapshot / key.split('/', 1)[1]
        if not target.is_file():
            tmp = target.with_name(f'.{target.name}.incomplete')
            shutil.copyfile(folder.parent / key, tmp)
            if _sha256(tmp) != entry['sha256']:
                tmp.unlink()
                raise RuntimeError(f'{folder.parent / key} is not the published file (its sha256 differs from '
                                   f"{folder.parent / 'MANIFEST.json'}'s): restore it (git checkout, or reinstall).")
            os.replace(tmp, target)
    (repo_cache / 'refs').mkdir(exist_ok=True)
    (repo_cache / 'refs' / 'main').write_text(commit)
    return snapshot


def _endpoint_problem(endpoint: str, hf_hub_id: str) -> Optional[str]:
    """Why a Hub endpoint cannot serve now (refused, unreachable, silent for ``ENDPOINT_TIMEOUT`` s), or None when it
    answers at all: one HEAD, where huggingface_hub would retry a dead endpoint for most of a minute."""
    if urllib.parse.urlsplit(endpoint).scheme not in ('http', 'https'):
        return 'not a URL: HF_ENDPOINT must start with http:// or https://'
    url = f'{endpoint.rstrip("/")}/{hf_hub_id}/resolve/main/config.json'
    not_hub = 'it answers, but not as a Hugging Face Hub does (no X-Repo-Commit or X-Error-Code header)'
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method='HEAD'), timeout=ENDPOINT_TIMEOUT) as r:
            return None if r.headers.get('X-Repo-Commit') else not_hub
    except urllib.error.HTTPError as e:
        # it answered: a Hub's answer (a missing repo, say) is the Hub client's to report
        return None if e.headers.get('X-Error-Code') or e.headers.get('X-Repo-Commit') else not_hub
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, 'reason', e)
        return 'no answer within {:g} s'.format(ENDPOINT_TIMEOUT) if isinstance(reason, TimeoutError) or \
            'timed out' in str(reason) else str(reason)


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """huggingface_hub in offline mode for one load: it reads the cache and sends nothing."""
    from huggingface_hub import constants
    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _mirror_advice(repo: str, endpoint: Optional[str] = None, offline: bool = False) -> str:
    folder = f'weights/{repo}' if (Path('weights') / repo).is_dir() else f'<folder of {repo}>'
    try:
        port = urllib.parse.urlsplit(endpoint).port if endpoint else None
    except ValueError:
        port = None
    port = port if port and port >= 1024 else None  # a port below 1024 needs root: the mirror's default then
    serve = 'python -m timm_odevit_tools.hub serve' + (f' --port {port}' if port else '')
    start = 'Unset HF_HUB_OFFLINE and start' if offline else 'Start'
    return (f'{start} the local Hub mirror with `{serve}` (it prints the HF_ENDPOINT to set before Python starts), '
            f"or load a folder of the weights directly: timm.create_model('local-dir:{folder}', pretrained=True).")


@contextlib.contextmanager
def pretrained_source(hf_hub_id: Optional[str], file: Optional[str] = None) -> Iterator[None]:
    """Around timm's pretrained load of one of our weights: decide where it comes from, before any request.

    - A Hub endpoint other than huggingface.co (``HF_ENDPOINT``: the local mirror) that answers: it serves, as usual.
    - One that does not answer within ``ENDPOINT_TIMEOUT`` s: a copy in the Hugging Face cache is loaded offline,
      else a RuntimeError names the endpoint, the command that starts the mirror and ``local-dir:``, at once (the Hub
      client would retry for most of a minute and then say only "check your connection").
    - huggingface.co (our weights are not there yet), or ``HF_HUB_OFFLINE=1``: the cached copy; else the copy this
      install carries (the default model's bundled weights, or a checkout's ``weights/``) is put in the Hugging Face
      cache and loaded from there; else the RuntimeError.
    Every cache load goes through timm's unmodified Hub loader with huggingface_hub offline for that call, and says
    once where the weights came from. A local file, or another organisation's repository, pass through untouched.
    """
    if not hf_hub_id or not hf_hub_id.startswith(f'{ORG}/') or file:
        yield
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from timm.models._hub import hf_split
    repo_id, revision = hf_split(hf_hub_id)  # '<repo>@<revision>': an older version, from a mirror or the cache only
    repo = repo_id.split('/', 1)[1]
    endpoint = constants.ENDPOINT.rstrip('/')
    cached = try_to_load_from_cache(repo_id, 'model.safetensors', revision=revision)
    cached = cached if isinstance(cached, str) else None
    if constants.HF_HUB_OFFLINE and cached is not None:
        yield  # offline by the user's choice (HF_HUB_OFFLINE): the cache serves, no request, nothing to say
        return
    if endpoint != 'https://huggingface.co' and not constants.HF_HUB_OFFLINE:
        problem = _endpoint_problem(endpoint, repo_id)
        if problem is None:
            yield
            return
        if cached is None:
            raise RuntimeError(f'The Hub endpoint HF_ENDPOINT={endpoint} cannot serve ({problem}), and {hf_hub_id} '
                               f'is not in the Hugging Face cache. {_mirror_advice(repo, endpoint)}')
        source = f'HF_ENDPOINT={endpoint} cannot serve ({problem}): {hf_hub_id} loads from the Hugging Face cache'
    elif cached is not None:
        source = f'{hf_hub_id} loads from the Hugging Face cache (not on huggingface.co yet)'
    else:
        local = _local_repo(repo_id) if revision is None else None  # an install carries main only
        if local is None:
            why = 'HF_HUB_OFFLINE=1 allows no download' if constants.HF_HUB_OFFLINE else 'no local Hub mirror is set'
            carried = sorted({k.split('/')[0] for root in local_weights_roots()
                              for k in json.loads((root / 'MANIFEST.json').read_text()).get('files', {})})
            raise RuntimeError(f'{hf_hub_id} is not on huggingface.co yet, this install does not carry it, and {why}. '
                               f'The weights this install carries: {", ".join(carried) or "none"}. '
                               f'{_mirror_advice(repo, offline=constants.HF_HUB_OFFLINE)}')
        snapshot = _seed_hub_cache(repo_id, *local)
        source = (f'{hf_hub_id} is not on huggingface.co yet: loading the copy installed with timm_odevit ({local[0]}),'
                  f' put in the Hugging Face cache ({snapshot})')
    warnings.warn(source + '.', stacklevel=4)
    with _hub_offline():
        yield


def check_local_weights(folder: str) -> None:
    """A ``local-dir:`` folder is checked as the mirror checks it: each file a ``MANIFEST.json`` in it or beside it
    lists must have the sha256 listed there (a damaged copy is refused, naming the file)."""
    folder_path = Path(folder)
    manifest = next((m for m in (folder_path / 'MANIFEST.json', folder_path.parent / 'MANIFEST.json') if m.is_file()),
                    None)
    prefix = '' if manifest is None or manifest.parent == folder_path else f'{folder_path.name}/'
    for key, entry in (json.loads(manifest.read_text()).get('files', {}) if manifest else {}).items():
        path = manifest.parent / key
        if key.startswith(prefix) and path.is_file() and _sha256(path) != entry.get('sha256'):
            raise RuntimeError(f'{path} is not the file {manifest} lists (its sha256 differs): the copy is damaged or '
                               'was changed; restore it (git checkout, or copy it again).')


def _sha256(path: Path) -> str:
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def mark_published_architectures() -> None:
    """``timm.is_model_pretrained(arch)`` true for each of our architectures with a published tag, which
    ``pretrained=True`` loads (create_depth_vit): timm marks only the default tag, which stays weightless
    (``keep_untagged_default``), and has no public setter."""
    from timm.models import _registry
    for name in list(_registry._model_has_pretrained):
        if '.' in name and (_registry._model_pretrained_cfgs[name].hf_hub_id or '').startswith(f'{ORG}/'):
            _registry._model_has_pretrained.add(name.split('.', 1)[0])


def route_hf_hub_configs() -> None:
    """Give timm's ``hf-hub:`` route the handling of ``pretrained=True``: timm reads an ``hf-hub:`` name's
    ``config.json`` before any builder of ours runs, so its loader is wrapped (once) to enter ``pretrained_source``
    for our repos, and to say which ``config.json`` names an architecture timm does not know."""
    from timm.models import _factory, is_model
    load = _factory.load_model_config_from_hf
    if getattr(load, '_timm_odevit', False):
        return

    def load_config(model_id: str, *args: Any, **kwargs: Any) -> Any:
        with pretrained_source(model_id if model_id.startswith(f'{ORG}/') else None):
            out = load(model_id, *args, **kwargs)
        if not is_model(out[1]):
            raise RuntimeError(f'The config.json of hf-hub:{model_id} names the architecture {out[1]!r}, which timm '
                               'does not know: fix its "architecture" field, or import the package that registers it '
                               "first (timm_odevit registers odevit_*, ssog_*, looped_* and dense_vit_*).")
        return out
    load_config._timm_odevit = True  # type: ignore[attr-defined]
    _factory.load_model_config_from_hf = load_config


def unreadable_weights_message(cfg: Any, error: BaseException) -> str:
    """What to say when the weights file a pretrained cfg points at cannot be read (truncated, corrupt): the file,
    and how to get a good copy."""
    if cfg.source == 'local-dir' or cfg.file:
        where = f'in {cfg.file}' if cfg.source == 'local-dir' else cfg.file
        fix = ('copy them again from where they came from (a checkout\'s weights/ holds every published weight, '
               'and `python -m timm_odevit_tools.hub verify --root weights` checks those against their sha256)')
    else:
        from huggingface_hub import constants, try_to_load_from_cache
        cached = try_to_load_from_cache(cfg.hf_hub_id, 'model.safetensors')
        where = cached if isinstance(cached, str) else f'the copy of {cfg.hf_hub_id} in {constants.HF_HUB_CACHE}'
        org, name = cfg.hf_hub_id.split('/', 1)
        fix = f'remove the folder {Path(constants.HF_HUB_CACHE) / f"models--{org}--{name}"} and load again'
    return (f'The pretrained weights {where} cannot be read, truncated or corrupt ({type(error).__name__}: {error}): '
            f'{fix}.')
