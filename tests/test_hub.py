"""Published weights through the local Hub mirror: protocol, cache behaviour, exactness, cards, bad input.

Every load runs in a fresh interpreter, because huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE / HF_HOME when it
is imported. The mirror runs in this process and records every request it serves.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from huggingface_hub import EvalResult, ModelCard
from safetensors.torch import load_file

import timm
import timm_odevit  # noqa: F401
from timm_odevit_tools import data as fm
from timm_odevit_tools.hub import ORG, MANIFEST_FILE, hub_id
from timm_odevit_tools.hub.demo import hub_env
from timm_odevit.models.pretrained import FMNIST_TAG
from timm_odevit_tools.hub.server import REFUSED_STATUS, HubMirror, _header_safe
from timm_odevit_tools.hub.export import stored_dtype
from timm_odevit_tools.hub.record import RECORD_FILE, read_record, read_results, top1
from timm_odevit_tools.hub.verify import build_manifest, sha256_file, verify_root, write_manifest
from tiers import slow_except

REPO_ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = REPO_ROOT / 'weights'
REPOS = sorted(p.name for p in WEIGHTS.iterdir() if p.is_dir())
# the one repo the protocol tests download (a small one: the looped SSoG model has 0.39M params)
PICK = next((r for r in REPOS if r.startswith('looped_ssog')), REPOS[0])
ARCH = PICK.split('.')[0]

_CLIENT = '''
import json, sys, torch, timm, timm_odevit
name, out = sys.argv[1], sys.argv[2]
kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
model = timm.create_model(name, **kw).eval()
torch.manual_seed(0)
x = torch.randn(4, model.in_chans, 32, 32)
with torch.no_grad():
    y = model(x)
torch.save({'x': x, 'y': y, 'arch': model.pretrained_cfg.get('architecture'), 'num_classes': model.num_classes,
            'in_chans': model.in_chans, 'type': type(model).__name__}, out)
'''


def run_client(mirror_url: str, hf_home: Path, name: str, out: Path, offline: bool = False,
               kwargs: Optional[Dict] = None) -> subprocess.CompletedProcess:
    kwargs = {'pretrained': True} if kwargs is None else kwargs
    return subprocess.run([sys.executable, '-c', _CLIENT, name, str(out), json.dumps(kwargs)],
                          env=hub_env(mirror_url, str(hf_home), offline), capture_output=True, text=True,
                          timeout=300, cwd=str(out.parent))


def reference_output(repo_dir: Path, x: torch.Tensor) -> torch.Tensor:
    """The exported model's output, built here from the folder's own files (no Hub code involved)."""
    cfg = json.loads((repo_dir / 'config.json').read_text())
    model = timm.create_model(cfg['architecture'], pretrained=False, **cfg['model_args']).eval()
    model.load_state_dict(load_file(str(repo_dir / 'model.safetensors')))
    with torch.no_grad():
        return model(x)


def file_requests(log: List[Tuple[str, str, int]], fname: str) -> List[Tuple[str, int]]:
    return [(m, s) for m, p, s in log if p.endswith('/' + fname)]


@pytest.fixture(scope='module')
def mirror():
    with HubMirror(str(WEIGHTS)) as m:
        yield m


def edit_record(repo: Path, edit: Callable[[Dict], None]) -> None:
    """Change a weights folder's record.json in place (``edit`` takes the record)."""
    path = Path(repo) / RECORD_FILE
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def edit_commands(repo: Path, old: str, new: str, stages: slice = slice(None)) -> int:
    """Replace ``old`` with ``new`` in the commands of a folder's record (``stages`` of them, e.g. ``slice(-1,
    None)`` for the last) and in their card lines; how many commands changed."""
    changed = []

    def edit(record: Dict) -> None:
        for stage in record['stages'][stages]:
            if old in stage['command']:
                stage['command'] = stage['command'].replace(old, new)
                stage['lines']['command'] = f'`{stage["command"]}`'
                changed.append(stage)
    edit_record(repo, edit)
    return len(changed)


def set_top1(repo: Path, value: float, data: str = 'full', solver: Optional[str] = None) -> None:
    """Set one top-1 of a folder's card model-index: on ``data`` ('sample' or 'full') at ``solver`` (default: the
    solver its record names, 'discrete' for a discrete model)."""
    path = Path(repo) / 'README.md'
    card = ModelCard.load(path)
    solver = solver or json.loads((Path(repo) / RECORD_FILE).read_text())['solver'] or 'discrete'
    hits = [r for r in card.data.eval_results if r.dataset_config == data and r.metric_config == solver]
    assert len(hits) <= 1, (repo, data, solver, card.data.eval_results)
    if hits:
        hits[0].metric_value = value
    else:  # a figure the export did not measure (e.g. the full test set after --no-full)
        like = card.data.eval_results[0]
        card.data.eval_results.append(EvalResult(task_type=like.task_type, dataset_type=like.dataset_type,
                                                 dataset_name=data, dataset_config=data, dataset_split='test',
                                                 metric_type='accuracy', metric_value=value, metric_config=solver))
    card.save(path)


def test_weights_folder_is_complete_and_matches_manifest():
    assert REPOS, 'no published weights under weights/'
    manifest = json.loads((WEIGHTS / MANIFEST_FILE).read_text())
    assert manifest == build_manifest(WEIGHTS), \
        'weights/MANIFEST.json is stale: run python -m timm_odevit_tools.hub manifest'
    assert all(not errs for errs in verify_root(WEIGHTS).values()), verify_root(WEIGHTS)
    for repo in REPOS:
        names = {p.name for p in (WEIGHTS / repo).iterdir()}
        assert names == {'model.safetensors', 'config.json', 'README.md', RECORD_FILE}, (repo, names)
        assert (WEIGHTS / repo / 'model.safetensors').stat().st_size < 25e6


@pytest.mark.parametrize('repo', REPOS)
def test_record_states_what_the_weights_are(repo):
    """A published folder's record.json agrees with its weights (name, params, input, stored precision, solver) and
    its card's model-index holds the top-1 on the sample and the full test set at that solver (and at the
    architecture's default where the record names one)."""
    from timm_odevit_tools.evaluate import solver_of
    record = read_record(WEIGHTS / repo)
    model = timm.create_model(f'local-dir:{WEIGHTS / repo}', pretrained=True)
    assert record['weights'] == repo and record['architecture'] == repo.split('.')[0]
    assert record['params'] == sum(p.numel() for p in model.parameters())
    assert record['input_size'] == list(model.pretrained_cfg['input_size'])
    assert record['stored_dtype'] == str(stored_dtype(WEIGHTS / repo / 'model.safetensors')).replace('torch.', '')
    assert (record['solver'] or 'discrete') == solver_of(model)
    results = read_results(WEIGHTS / repo)
    for data in ('sample', 'full'):
        assert top1(results, data, record['solver']) is not None, (repo, data)
        if record['default_solver']:
            assert top1(results, data, record['default_solver']) is not None, (repo, data)
    assert [s['command'] for s in record['stages']] and all(s['lines']['command'] == f'`{s["command"]}`'
                                                            for s in record['stages'])


def test_tag_registered_exactly_when_weights_exist():
    ours = set(timm.list_models(module=['odevit', 'ssog']))
    listed = {n for n in timm.list_pretrained() if n.split('.')[0] in ours}
    published = {n for n in listed if '.' in n}
    assert published == set(REPOS)
    # an architecture with a published tag is listed untagged too: pretrained=True loads its first tag
    assert listed - published == {r.split('.')[0] for r in REPOS}
    for name in published:
        cfg = timm.models.get_pretrained_cfg(name)
        arch, tag = name.split('.')
        assert cfg.hf_hub_id == hub_id(arch, tag) == f'{ORG}/{name}'
        # the untagged cfg stays the default: plain names keep 3 channels and 1000 classes
        assert timm.create_model(arch, pretrained=False).num_classes == 1000


@pytest.mark.parametrize('repo', slow_except(REPOS, fast=lambda r: not r.startswith(('dense_vit', 'ssog_vit'))))
def test_config_json_is_what_save_for_hf_writes(repo, tmp_path):
    stored = WEIGHTS / repo / 'model.safetensors'
    model = timm.create_model(f'local-dir:{WEIGHTS / repo}', pretrained=True)
    # timm loads into a float32 model; a weight stored in float16 is saved back in its own dtype, as export does
    timm.models.save_for_hf(model.to(stored_dtype(stored)), str(tmp_path), safe_serialization=True)
    exported = json.loads((WEIGHTS / repo / 'config.json').read_text())
    assert json.loads((tmp_path / 'config.json').read_text()) == exported
    # digests, not bytes: a failing bytes comparison of a 10 MB file makes pytest diff it for an hour
    assert sha256_file(tmp_path / 'model.safetensors') == sha256_file(stored)


@pytest.mark.slow
def test_fresh_cache_head_get_then_warm_head_only_then_offline_none(mirror, tmp_path):
    hf_home = tmp_path / 'hf'
    name = f'{ARCH}.{FMNIST_TAG}'
    mirror.clear_log()
    r = run_client(mirror.url, hf_home, name, tmp_path / 'a.pt')
    assert r.returncode == 0, r.stderr
    assert file_requests(mirror.log, 'model.safetensors') == [('HEAD', 200), ('GET', 200)], mirror.log
    a = torch.load(tmp_path / 'a.pt')
    # to the bit: the Hub-loaded model equals the exported folder built by hand
    assert torch.equal(a['y'], reference_output(WEIGHTS / PICK, a['x']))
    assert (a['arch'], a['num_classes'], a['in_chans']) == (ARCH, 10, 1)

    mirror.clear_log()
    r = run_client(mirror.url, hf_home, name, tmp_path / 'b.pt')
    assert r.returncode == 0, r.stderr
    assert file_requests(mirror.log, 'model.safetensors') == [('HEAD', 200)], mirror.log
    assert all(m == 'HEAD' for m, _, _ in mirror.log)
    assert torch.equal(torch.load(tmp_path / 'b.pt')['y'], a['y'])

    mirror.clear_log()
    r = run_client(mirror.url, hf_home, name, tmp_path / 'c.pt', offline=True)
    assert r.returncode == 0, r.stderr
    assert mirror.log == []
    assert torch.equal(torch.load(tmp_path / 'c.pt')['y'], a['y'])


def test_hf_hub_prefix_builds_model_from_config_json(mirror, tmp_path):
    mirror.clear_log()
    r = run_client(mirror.url, tmp_path / 'hf', f'hf-hub:{ORG}/{PICK}', tmp_path / 'h.pt')
    assert r.returncode == 0, r.stderr
    assert ('GET', 200) in file_requests(mirror.log, 'config.json')
    h = torch.load(tmp_path / 'h.pt')
    assert (h['arch'], h['num_classes'], h['in_chans'], h['type']) == (ARCH, 10, 1, 'DepthVisionTransformer')
    assert torch.equal(h['y'], reference_output(WEIGHTS / PICK, h['x']))


def test_local_dir_prefix(tmp_path):
    model = timm.create_model(f'local-dir:{WEIGHTS / PICK}', pretrained=True).eval()
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), reference_output(WEIGHTS / PICK, x))


def _request(url: str, method: str = 'GET', headers: Optional[Dict[str, str]] = None):
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_protocol_headers_range_and_404_codes(mirror):
    base = f'{mirror.url}/{ORG}/{PICK}/resolve/main'
    entry = json.loads((WEIGHTS / MANIFEST_FILE).read_text())['files'][f'{PICK}/model.safetensors']
    status, h, body = _request(f'{base}/model.safetensors', 'HEAD')
    assert status == 200 and body == b''
    assert re.fullmatch(r'[0-9a-f]{40}', h['X-Repo-Commit'])
    assert h['ETag'] == f'"{entry["sha256"]}"' and int(h['Content-Length']) == entry['size']
    # the commit id resolves like main
    status, h2, _ = _request(f'{mirror.url}/{ORG}/{PICK}/resolve/{h["X-Repo-Commit"]}/config.json', 'HEAD')
    assert status == 200
    status, h3, part = _request(f'{base}/model.safetensors', headers={'Range': 'bytes=8-15'})
    assert status == 206 and part == (WEIGHTS / PICK / 'model.safetensors').read_bytes()[8:16]
    assert h3['Content-Range'] == f'bytes 8-15/{entry["size"]}'

    status, h, body = _request(f'{mirror.url}/{ORG}/no_such_model.fmnist/resolve/main/config.json', 'HEAD')
    assert (status, h['X-Error-Code']) == (404, 'RepoNotFound')
    status, h, body = _request(f'{mirror.url}/other-org/{PICK}/resolve/main/config.json')
    assert (status, h['X-Error-Code']) == (404, 'RepoNotFound') and b'not found' in body
    assert b'restart the mirror with --org other-org' in body  # another org: what the mirror serves
    status, h, _ = _request(f'{base}/pytorch_model.bin', 'HEAD')
    assert (status, h['X-Error-Code']) == (404, 'EntryNotFound') and re.fullmatch(r'[0-9a-f]{40}', h['X-Repo-Commit'])
    status, h, _ = _request(f'{base}/../../{REPOS[-1]}/resolve/main/config.json', 'HEAD')
    assert status == 404
    status, h, _ = _request(f'{mirror.url}/{ORG}/{PICK}/resolve/v9/config.json', 'HEAD')
    assert (status, h['X-Error-Code']) == (404, 'RevisionNotFound')
    status, h, body = _request(f'{mirror.url}/api/models/{ORG}/{PICK}')
    info = json.loads(body)
    assert status == 200 and {s['rfilename'] for s in info['siblings']} == {'model.safetensors', 'config.json',
                                                                             'README.md', RECORD_FILE}


def test_missing_repo_and_file_raise_hub_errors(mirror, tmp_path):
    code = ('import sys\nfrom huggingface_hub import hf_hub_download\n'
            'try:\n    hf_hub_download(sys.argv[1], sys.argv[2])\n'
            'except Exception as e:\n    print(type(e).__name__)\n')
    env = hub_env(mirror.url, str(tmp_path / 'hf'))
    out = [subprocess.run([sys.executable, '-c', code, repo, f], env=env, capture_output=True, text=True,
                          timeout=120).stdout.strip()
           for repo, f in ((f'{ORG}/nope.fmnist', 'config.json'), (f'{ORG}/{PICK}', 'missing.bin'))]
    assert out == ['RepositoryNotFoundError', 'RemoteEntryNotFoundError'] or out == ['RepositoryNotFoundError',
                                                                                    'EntryNotFoundError'], out


_EVAL_CLIENT = """
import json, sys, traceback, timm, timm_odevit
from timm_odevit_tools import data as fm
from timm_odevit_tools.evaluate import evaluate
for name in sys.argv[2:]:
    try:
        model = timm.create_model(name, pretrained=True)
        r = evaluate(model, fm.load_tensors(fm.SAMPLE_DIR, model=model, cache_root=sys.argv[1]))
        out = {'correct': r['correct'], 'n': r['n'], 'tag': model.pretrained_cfg.get('tag'),
               'input_size': list(model.pretrained_cfg['input_size'])}
    except Exception:
        out = {'error': traceback.format_exc()}
    print(json.dumps(dict(out, name=name)), flush=True)
"""
# the untagged name first: nothing an earlier download did in the interpreter can help it resolve
UNTAGGED_DEFAULT = 'ssog_ode_small'


def _sample_counts(card: str) -> Tuple[int, int]:
    """Correct and total of the card's top-1 on the bundled sample."""
    m = re.search(r'sample \(1,000 test images, bundled\): top-1 [\d.]+% \((\d+)/(\d+)\)', card)
    assert m, 'the model card lacks the sample top-1'
    return int(m.group(1)), int(m.group(2))


def _card_sample_top1(repo: str) -> Tuple[int, int]:
    card = (WEIGHTS / repo / 'README.md').read_text()
    for needed in ('Params (M)', 'GMACs', 'License', 'Training recipe', 'python -m timm_odevit_tools.hub evaluate',
                   'Fashion-MNIST test set (10,000 images)', 'pretrained=True'):
        assert needed in card, needed
    return _sample_counts(card)


@pytest.fixture(scope='module')
def mirror_top1(mirror, tmp_path_factory) -> Dict[str, Dict]:
    """Every published weight and the untagged default, each created by name from the mirror and scored on the
    sample, in one client interpreter (one start, one sample cache): name -> its result, or its traceback."""
    hf_home = tmp_path_factory.mktemp('hf_top1')
    names = [UNTAGGED_DEFAULT] + REPOS
    out = subprocess.run([sys.executable, '-c', _EVAL_CLIENT, str(hf_home / 'data')] + names,
                         env=hub_env(mirror.url, str(hf_home)), capture_output=True, text=True, timeout=1200,
                         cwd=str(hf_home))
    results = {r['name']: r for r in map(json.loads, re.findall(r'^\{.*\}$', out.stdout, flags=re.M))}
    assert list(results) == names, out.stderr[-3000:]
    return results


def _top1(results: Dict[str, Dict], name: str) -> Dict:
    assert 'error' not in results[name], results[name].get('error')
    return results[name]


@pytest.mark.slow
@pytest.mark.parametrize('repo', REPOS)
def test_card_top1_reproduces_through_mirror(repo, mirror_top1):
    """Each published weight, downloaded from the mirror by name, scores on the sample what its card says."""
    correct, n = _card_sample_top1(repo)
    r = _top1(mirror_top1, repo)
    assert (r['correct'], r['n']) == (correct, n)
    assert r['tag'] == repo.split('.', 1)[1]


@pytest.mark.slow
def test_untagged_name_with_pretrained_loads_the_published_tag(mirror_top1):
    """create_model('ssog_ode_small', pretrained=True) works: the only published tag of that arch is loaded."""
    repo = next(r for r in REPOS if r.split('.')[0] == UNTAGGED_DEFAULT)
    r = _top1(mirror_top1, UNTAGGED_DEFAULT)
    assert r['tag'] == repo.split('.', 1)[1]
    assert (r['correct'], r['n']) == _card_sample_top1(repo)
    plain = timm.create_model(UNTAGGED_DEFAULT)  # without pretrained: still the architecture's 224-px default
    assert (plain.num_classes, plain.in_chans) == (1000, 3)


# ---- bad input: each refused with the file named and the fix, nothing broken left in the client cache ----

@pytest.fixture()
def bad_root(tmp_path):
    root = tmp_path / 'weights'
    root.mkdir()
    shutil.copytree(WEIGHTS / PICK, root / PICK)
    write_manifest(root)
    return root


def _corrupt_truncate(root: Path) -> None:
    f = root / PICK / 'model.safetensors'
    f.write_bytes(f.read_bytes()[:-1000])


def _corrupt_flip(root: Path) -> None:
    f = root / PICK / 'model.safetensors'
    b = bytearray(f.read_bytes())
    b[-5] ^= 0xFF
    f.write_bytes(bytes(b))


def _corrupt_header_consistent(root: Path) -> None:
    # a broken export whose manifest was regenerated: sha256 matches, the safetensors header does not parse
    f = root / PICK / 'model.safetensors'
    f.write_bytes(f.read_bytes()[:200])
    write_manifest(root)


def _unknown_arch(root: Path) -> None:
    f = root / PICK / 'config.json'
    cfg = json.loads(f.read_text())
    cfg['architecture'] = 'no_such_arch_tiny'
    f.write_text(json.dumps(cfg, indent=2))
    write_manifest(root)


def _other_arch_weights(root: Path) -> None:
    other = next(r for r in REPOS if r != PICK and not r.startswith('looped'))
    shutil.copy(WEIGHTS / other / 'model.safetensors', root / PICK / 'model.safetensors')
    write_manifest(root)


BAD = {
    'truncated': (_corrupt_truncate, 'model.safetensors', 'size'),
    'sha256_mismatch': (_corrupt_flip, 'model.safetensors', 'sha256'),
    'corrupted_header': (_corrupt_header_consistent, 'model.safetensors', 'not a complete safetensors file'),
    'unknown_architecture': (_unknown_arch, 'config.json', "names architecture 'no_such_arch_tiny'"),
    'other_architecture_weights': (_other_arch_weights, 'model.safetensors', 'does not hold weights of'),
}


@pytest.mark.slow
@pytest.mark.parametrize('case', sorted(BAD))
def test_bad_repo_refused_with_file_and_fix(case, bad_root, tmp_path):
    breaker, bad_file, what = BAD[case]
    breaker(bad_root)
    errs = verify_root(bad_root)[PICK]
    assert errs and str(bad_root / PICK / bad_file) in str(errs[0]) and what in str(errs[0])
    assert 'python -m timm_odevit_tools.hub' in str(errs[0]) or 'import timm_odevit' in str(errs[0])
    hf_home = tmp_path / 'hf'
    with HubMirror(str(bad_root)) as m:
        name = f'hf-hub:{ORG}/{PICK}' if bad_file == 'config.json' else f'{ARCH}.{FMNIST_TAG}'
        r = run_client(m.url, hf_home, name, tmp_path / 'x.pt')
        assert r.returncode != 0
        # the mirror's reason is the last line the user sees, not a generic "check your connection"
        last = r.stderr.strip().splitlines()[-1]
        assert what in last and bad_file in last, r.stderr[-2000:]
        # refused once: a status huggingface_hub does not retry (it retries 5xx for about half a minute); an hf-hub:
        # name's config.json is asked once more, before, by the one HEAD that checks the endpoint (pretrained_source)
        probes = 1 if name.startswith('hf-hub:') else 0
        assert [(mm, st) for mm, p, st in m.log if p.endswith(bad_file)] == [('HEAD', REFUSED_STATUS)] * (1 + probes), \
            m.log
        status, h, body = _request(f'{m.url}/{ORG}/{PICK}/resolve/main/{bad_file}', 'HEAD')
        assert status == REFUSED_STATUS and what in h['X-Error-Message'] and bad_file in h['X-Error-Message']
    # the client cache holds no copy (complete or partial) of the refused file
    cached = [p for p in hf_home.rglob('*') if p.is_file() and (p.name == bad_file or p.suffix == '.incomplete')]
    assert cached == []
    cli = subprocess.run([sys.executable, '-m', 'timm_odevit_tools.hub', 'verify', '--root', str(bad_root)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and 'FAILED' in cli.stdout and what in cli.stdout


def test_a_record_that_is_not_the_folders_is_refused(bad_root):
    """record.json must parse and describe its folder (name and architecture): another folder's record, or a
    broken one, fails verify and the mirror refuses the repo, naming the file and the fix."""
    path = bad_root / PICK / RECORD_FILE
    other = next(r for r in REPOS if r.partition('.')[0] != ARCH)
    shutil.copy(WEIGHTS / other / RECORD_FILE, path)
    write_manifest(bad_root)
    (err,) = verify_root(bad_root)[PICK]
    assert str(path) in str(err) and f"describes {other!r}" in str(err) and 'remeasure' in str(err)
    with HubMirror(str(bad_root)) as m:
        status, h, _ = _request(f'{m.url}/{ORG}/{PICK}/resolve/main/config.json', 'HEAD')
        assert status == REFUSED_STATUS and RECORD_FILE in h['X-Error-Message']
    path.write_text('{"weights": ')
    write_manifest(bad_root)
    (err,) = verify_root(bad_root)[PICK]
    assert 'not valid JSON' in str(err) and 'git checkout' in str(err)


def test_mirror_sends_only_bytes_that_match_the_manifest(bad_root):
    """A file changed in place behind the mirror's back is never served (issue 14, item 2)."""
    f = bad_root / PICK / 'model.safetensors'
    original = f.read_bytes()
    with HubMirror(str(bad_root)) as m:
        url = f'{m.url}/{ORG}/{PICK}/resolve/main/model.safetensors'
        assert _request(url)[2] == original
        # same size and the old mtime: a change that the mirror's change detection cannot see
        st = f.stat()
        changed = bytearray(original)
        changed[-5] ^= 0xFF
        f.write_bytes(bytes(changed))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        status, _, body = _request(url)
        assert status == 200 and body == original, 'served bytes that do not hash to the manifest'
        # a change it does see is checked again, and refused
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
        assert _request(url, 'HEAD')[0] == REFUSED_STATUS


def test_file_rewritten_during_a_download_does_not_mix(tmp_path):
    """A re-export that rewrites a file while a client downloads it: the client gets the old bytes, whole."""
    big = max(REPOS, key=lambda r: (WEIGHTS / r / 'model.safetensors').stat().st_size)
    root = tmp_path / 'weights'
    root.mkdir()
    shutil.copytree(WEIGHTS / big, root / big)
    write_manifest(root)
    f = root / big / 'model.safetensors'
    original = f.read_bytes()
    with HubMirror(str(root)) as m:
        with urllib.request.urlopen(f'{m.url}/{ORG}/{big}/resolve/main/model.safetensors', timeout=60) as resp:
            head = resp.read(1 << 16)
            f.write_bytes((~np.frombuffer(original, np.uint8)).tobytes())  # every byte changed, in place
            body = head + resp.read()
    assert body == original


def _raw(url: str, path: str, method: str = 'GET', headers: Optional[Dict[str, str]] = None):
    # http.client sends the path as given (urllib would re-quote it)
    import http.client
    host, port = url.split('//')[1].split(':')
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_malformed_requests_get_an_answer(mirror):
    base = f'/{ORG}/{PICK}/resolve/main'
    size = (WEIGHTS / PICK / 'model.safetensors').stat().st_size
    cases = {
        f'{base}/%00': 400,                                # NUL: would crash every path operation
        f'{base}/model.safetensors%0D%0AX-Injected:%201': 400,   # CR/LF: a header injection attempt
        f'{base}/%FF%FE.bin': 400,                         # not UTF-8
        f'{base}/%E2%98%83.bin': 404,                      # a non-Latin-1 name: a plain EntryNotFound
    }
    for path, want in cases.items():
        status, h, _ = _raw(mirror.url, path)
        assert status == want, (path, status)
        assert 'X-Injected' not in h
        if want == 404:
            assert h['X-Error-Code'] == 'EntryNotFound' and '\\u2603' in h['X-Error-Message']
    for rng in ('bytes=' + '9' * 5000 + '-', 'bytes=0-' + '9' * 5000, 'bytes=abc', f'bytes={size}-'):
        status, h, _ = _raw(mirror.url, f'{base}/model.safetensors', headers={'Range': rng})
        assert status == 416 and h['Content-Range'] == f'bytes */{size}', (rng[:20], status)
    # the mirror still serves normally afterwards
    assert _raw(mirror.url, f'{base}/config.json')[0] == 200


def test_error_message_header_is_one_safe_line():
    assert _header_safe('bad\r\nX-Injected: 1\x00 \u2603') == 'bad X-Injected: 1  \\u2603'


@pytest.mark.parametrize('manifest', ['[]', '{"files": []}', '{"files": {"x/model.safetensors": "abc"}}',
                                      '{"files": {"x/config.json": {"sha256": 1, "size": "2"}}}', '"text"'])
def test_manifest_of_the_wrong_json_type_is_refused_not_a_crash(manifest, bad_root):
    (bad_root / MANIFEST_FILE).write_text(manifest)
    errs = verify_root(bad_root)
    assert list(errs) == [''] and MANIFEST_FILE in str(errs[''][0])
    assert 'python -m timm_odevit_tools.hub manifest' in str(errs[''][0])
    with HubMirror(str(bad_root)) as m:
        status, h, _ = _request(f'{m.url}/{ORG}/{PICK}/resolve/main/config.json', 'HEAD')
    assert status == REFUSED_STATUS and MANIFEST_FILE in h['X-Error-Message']


def test_export_and_push_dry_run(tmp_path):
    model = timm.create_model(f'local-dir:{WEIGHTS / PICK}', pretrained=True)
    from timm_odevit_tools.hub.export import export, push, stored_dtype
    # exported again in the precision the file stores, the weights come back byte for byte
    repo = export(model, ARCH, 'copy', str(tmp_path), dtype=stored_dtype(WEIGHTS / PICK / 'model.safetensors'))
    assert sorted(p.name for p in repo.iterdir()) == ['README.md', 'config.json', 'model.safetensors', RECORD_FILE]
    assert read_record(repo)['stages'] == []  # weights of unknown provenance: no recipe to state
    assert sha256_file(repo / 'model.safetensors') == sha256_file(WEIGHTS / PICK / 'model.safetensors')
    assert json.loads((tmp_path / MANIFEST_FILE).read_text()) == build_manifest(tmp_path)
    lines = push(str(WEIGHTS / PICK), dry_run=True)
    assert lines[0].startswith(f'repo: {ORG}/{PICK}') and lines[-1] == 'dry run: nothing sent'
    assert 'byte-identical' in lines[1] and 'DIFFERS' not in '\n'.join(lines)


@pytest.mark.slow
def test_export_in_half_precision_measures_the_stored_weights(tmp_path, monkeypatch, sample_first_100):
    """--dtype float16 stores half-size weights; the card's top-1 is measured on the values the file holds (what a
    user's float32 model loads), the card says so, and a push sends the same bytes back."""
    from safetensors.torch import load_file
    from timm_odevit_tools.hub import export as ex
    from timm_odevit_tools.hub.__main__ import evaluate_folder, main as hub_main
    arch = 'ssog_ode_tiny_patch4_32'
    trained = timm.create_model(f'local-dir:{WEIGHTS / f"{arch}.fmnist"}', pretrained=True)
    ckpt = tmp_path / 'last.pth.tar'
    # a published weight may already hold float16 values: a relative nudge of 2**-14 gives every nonzero one more
    # mantissa bits than float16 keeps, so that rounding must change them (top-1 is unchanged at this scale)
    state = {k: v * (1 + 2 ** -14) if v.is_floating_point() else v for k, v in trained.state_dict().items()}
    torch.save({'arch': arch, 'state_dict': state}, ckpt)
    measured = {}

    def measure_spy(model, *args, **kwargs):
        measured[len(measured)] = {k: v.clone() for k, v in model.state_dict().items()}
        return real_measure(model, *args, **kwargs)
    real_measure = ex.measure
    monkeypatch.setattr(ex, 'measure', measure_spy)
    root = tmp_path / 'weights'
    for dtype in ('float32', 'float16'):
        assert hub_main(['export', str(ckpt), '--tag', dtype, '--root', str(root), '--dtype', dtype, '--no-full']) == 0
    full, half = (root / f'{arch}.{dtype}' for dtype in ('float32', 'float16'))
    assert ex.stored_dtype(full / 'model.safetensors') == torch.float32
    assert ex.stored_dtype(half / 'model.safetensors') == torch.float16
    assert (half / 'model.safetensors').stat().st_size < 0.55 * (full / 'model.safetensors').stat().st_size
    stored = load_file(half / 'model.safetensors')
    assert not all(torch.equal(measured[0][k], v.float()) for k, v in stored.items())  # rounding changed values
    assert all(torch.equal(measured[1][k], v.float()) for k, v in stored.items())  # and the card measured them
    card = (half / 'README.md').read_text()
    assert '**Stored precision:** float16' in card and 'Stored precision' not in (full / 'README.md').read_text()
    assert evaluate_folder(str(half), 'sample')['correct'] == _sample_counts(card)[0]
    lines = ex.push(str(half), dry_run=True)
    assert 'byte-identical' in lines[1] and 'DIFFERS' not in '\n'.join(lines)


@pytest.mark.slow
def test_card_measures_an_ode_weight_also_at_its_architectures_default_solver(sample_first_100):
    """An ODE weight trained on another grid than its architecture's default is measured as it is solved (what
    pretrained=True gives) and, on each test set, at that default too, with the command that reproduces each; the
    model is left solved as it came."""
    from timm_odevit_tools.evaluate import evaluate
    from timm_odevit_tools.hub.export import architecture_solver, measure
    arch = 'ssog_ode_tiny_patch4_32'
    model = timm.create_model(f'local-dir:{WEIGHTS / f"{arch}.fmnist"}', pretrained=True, ode_steps=5)
    default = architecture_solver(arch, model)
    assert (default['method'], default['steps']) == ('euler', 12)
    metrics = measure(model, f'weights/{arch}.fmnist', full_test=False, other_solver=default)
    sample, other = list(metrics)
    assert other == f"{sample}, at the architecture's default solver (euler, 12 steps)" and model.trunk.steps == 5
    assert metrics[sample]['command'].endswith('--data sample')
    assert metrics[other]['command'].endswith('--data sample --solver euler:12')
    images = fm.load_tensors(fm.SAMPLE_DIR, 'test', model=model)
    assert metrics[sample]['correct'] == evaluate(model, images)['correct']
    model.set_solver(steps=12)
    assert metrics[other]['correct'] == evaluate(model, images)['correct']
    assert architecture_solver(arch, model) is None  # at the default: one figure per test set
    assert architecture_solver('ssog_vit_tiny_patch4_32', timm.create_model('ssog_vit_tiny_patch4_32')) is None


@pytest.mark.slow
def test_card_gives_an_ode_weights_top1_against_the_solver(sample_first_100):
    """With solvers=True (`hub export/remeasure --solver-table`) an ODE weight is also measured on the sample at each
    solver of solver_table, each with NFE and the command that reproduces it, the registered solver once; the model
    is left solved as it came. (On the sample's first 100 images: dopri5 on all 1,000 takes a minute.)"""
    from timm_odevit_tools.evaluate import evaluate
    from timm_odevit_tools.hub.card import model_card
    from timm_odevit_tools.hub.export import measure, solver_table
    assert solver_table(23) == ['euler:6', 'euler:12', 'euler:23', 'euler:46', 'midpoint:3', 'midpoint:6',
                                'midpoint:12', 'rk4:1', 'rk4:3', 'rk4:6', 'dopri5']
    assert solver_table(4) == ['euler:1', 'euler:2', 'euler:4', 'euler:8', 'midpoint:1', 'midpoint:2', 'rk4:1',
                               'dopri5']
    arch = 'ssog_ode_tiny_patch4_32'
    model = timm.create_model(f'local-dir:{WEIGHTS / f"{arch}.fmnist"}', pretrained=True, ode_steps=4)
    metrics = measure(model, f'weights/{arch}.fmnist', full_test=False, solvers=True)
    sample, *table = list(metrics)
    assert metrics[sample]['n'] == 100
    assert [metrics[k]['solver'] for k in table] == [t for t in solver_table(4) if t != 'euler:4']
    assert model.trunk.method == 'euler' and model.trunk.steps == 4
    rk4 = next(k for k in table if metrics[k]['solver'] == 'rk4:1')
    assert rk4 == f'{sample}, solved with rk4 (1 step, NFE 4)', rk4
    assert metrics[rk4]['command'] == f'python -m timm_odevit_tools.hub evaluate weights/{arch}.fmnist --data sample ' \
                                      '--solver rk4:1'
    adaptive = metrics[table[-1]]
    assert table[-1].startswith(f'{sample}, solved with dopri5 (adaptive, NFE ') and adaptive['nfe'] > 4
    images = fm.load_tensors(fm.SAMPLE_DIR, 'test', model=model)
    model.set_solver(method='rk4', steps=1)
    assert metrics[rk4]['correct'] == evaluate(model, images)['correct']
    record = {'weights': f'{arch}.fmnist', 'architecture': arch, 'stages': [], 'input_size': [1, 32, 32],
              'params': 1, 'gmacs': 1., 'solver': 'euler:4', 'stored_dtype': 'float32', 'description': None}
    measured = model_card(record, metrics)['details']['Measured']
    assert f'top-1 {metrics[rk4]["top1"]:.2f}%' in measured[rk4] and metrics[rk4]['command'] in measured[rk4]


@pytest.mark.slow
def test_remeasure_keeps_a_cards_solver_table_unless_told(tmp_path, sample_first_100):
    """`hub remeasure` without --solver-table keeps the table a card has; --no-solver-table drops it. (On the
    sample's first 100 images, as above.)"""
    from timm_odevit_tools.hub.__main__ import main as hub_main
    name = next(r for r in REPOS if r.startswith(f'{UNTAGGED_DEFAULT}.'))
    repo = tmp_path / 'weights' / name
    shutil.copytree(WEIGHTS / name, repo)
    assert '--data sample --solver rk4:' in (repo / 'README.md').read_text()
    assert hub_main(['remeasure', str(repo), '--no-full']) == 0
    card = (repo / 'README.md').read_text()
    assert '--data sample --solver rk4:' in card and '/100)' in card  # measured again
    assert hub_main(['remeasure', str(repo), '--no-full', '--no-solver-table']) == 0
    assert '--solver rk4:' not in (repo / 'README.md').read_text()


def test_every_published_ode_card_gives_top1_against_the_solver():
    """The cards of the published ODE weights carry their solver table (`hub remeasure --solver-table`)."""
    from timm_odevit.models.families import family_of
    from timm_odevit_tools.hub.export import solver_table
    ode = [repo for repo in REPOS if family_of(repo.split('.')[0]).depth == 'ode']
    assert len(ode) == 5, ode
    for repo in ode:
        card = (WEIGHTS / repo / 'README.md').read_text()
        registered = json.loads((WEIGHTS / repo / 'record.json').read_text())['solver']
        for solver in solver_table(int(registered.split(':')[1])):
            assert solver == registered or f'--data sample --solver {solver}`' in card, (repo, solver)


def test_an_ode_tag_solves_as_its_weights_were_trained_by_every_route(tmp_path):
    """A tag whose weights trained on another grid than the architecture's default is solved on that grid by name and
    through its config.json (local-dir:, hf-hub:) alike, as its card's last command trained it; a solver kwarg the
    caller passes wins, the untagged architecture keeps its default, and a re-serialised model keeps the grid."""
    from timm_odevit_tools.hub.export import trained_solver
    from experiments.tables import stage_commands
    from timm_odevit.models.pretrained import TAG_MODEL_ARGS, tag_model_args
    from timm_odevit_tools.train import recorded_args
    for repo in REPOS:
        arch, tag = repo.split('.')
        config = json.loads((WEIGHTS / repo / 'config.json').read_text())
        trained = trained_solver(recorded_args(stage_commands(WEIGHTS / repo)[-1]).model_kwargs)
        assert trained_solver(config['model_args']) == trained == tag_model_args(arch, tag), repo
    assert set(TAG_MODEL_ARGS) <= set(REPOS)
    name = 'ssog_ode_tiny_patch4_32.fmnist'
    steps = TAG_MODEL_ARGS[name]['ode_steps']
    assert timm.create_model(name).trunk.steps == steps != timm.create_model(name.split('.')[0]).trunk.steps
    assert timm.create_model(f'local-dir:{WEIGHTS / name}').trunk.steps == steps
    assert timm.create_model(name, ode_steps=12).trunk.steps == 12
    timm.models.save_for_hf(timm.create_model(name), str(tmp_path), safe_serialization=True)
    assert json.loads((tmp_path / 'config.json').read_text())['model_args']['ode_steps'] == steps


@pytest.mark.slow
def test_remeasure_rerenders_a_folder_at_the_solver_it_trained_with(tmp_path, sample_first_100):
    """`hub remeasure` re-measures a published folder at the solver its last stage trained with and re-renders its
    card, record (the stages kept) and config.json; the weights file keeps its bytes and the folder verifies. A
    folder whose record states no stage, or has no record, is refused, naming the fix."""
    from timm_odevit_tools.hub.__main__ import evaluate_folder, main as hub_main
    name = 'ssog_ode_tiny_patch4_32.fmnist'
    repo = tmp_path / 'weights' / name
    shutil.copytree(WEIGHTS / name, repo)
    config = json.loads((repo / 'config.json').read_text())
    config['model_args'].pop('ode_steps', None)  # as exported before the export kept the trained solver
    (repo / 'config.json').write_text(json.dumps(config))
    before = read_record(repo)
    (repo / 'README.md').write_text('a card whose wording changed: nothing is read back from it')
    assert hub_main(['remeasure', str(repo), '--no-full']) == 0
    assert json.loads((repo / 'config.json').read_text())['model_args']['ode_steps'] == 23
    card = (repo / 'README.md').read_text()
    assert read_record(repo) == before and '- **ODE solver:** euler, 23 steps (' in card
    assert sha256_file(repo / 'model.safetensors') == sha256_file(WEIGHTS / name / 'model.safetensors')
    assert all(not errs for errs in verify_root(tmp_path / 'weights').values())
    sample = evaluate_folder(str(repo), 'sample')
    assert sample['correct'] == _sample_counts(card)[0]
    assert top1(read_results(repo), 'sample', 'euler:23') == round(sample['top1'], 2)
    edit_record(repo, lambda record: record.update(stages=[]))
    with pytest.raises(ValueError, match='states no recipe'):
        hub_main(['remeasure', str(repo), '--no-full'])
    (repo / RECORD_FILE).unlink()
    with pytest.raises(ValueError, match=f'{RECORD_FILE} is missing.*hub remeasure'):
        hub_main(['remeasure', str(repo), '--no-full'])


@pytest.mark.slow
def test_demo_prints_top1_through_mirror(capsys):
    from timm_odevit_tools.hub.demo import DEFAULT_MODEL, DEFAULT_REPO, main
    # the weights the demo's untagged name resolves to (test_untagged_name_... above)
    assert (DEFAULT_REPO,) == tuple(r for r in REPOS if r.split('.')[0] == DEFAULT_MODEL)
    assert main() == 0
    out = capsys.readouterr().out
    assert f">>> timm.create_model('{DEFAULT_MODEL}', pretrained=True)" in out
    sample = _card_sample_top1(DEFAULT_REPO)
    assert f'top-1 on the bundled sample {100 * sample[0] / sample[1]:.2f}% ({sample[0]}/{sample[1]})' in out
    assert 'HEAD' in out and 'GET' in out and 'model.safetensors' in out


def test_export_records_the_size_the_run_trained_at(tmp_path):
    """A run trained with --model-kwargs img_size=N exports at N px without being told again (a 224-px architecture
    trained small, like ssog_ode_small at 64 px); --img-size still overrides it."""
    import argparse
    from timm_odevit_tools.hub.__main__ import main as hub_main
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10, in_chans=1, img_size=16)
    ckpt = tmp_path / 'last.pth.tar'
    args = argparse.Namespace(model='ssog_ode_tiny_patch4_32', model_kwargs={'img_size': 16})
    torch.save({'arch': 'ssog_ode_tiny_patch4_32', 'state_dict': model.state_dict(), 'args': args}, ckpt)
    assert hub_main(['export', str(ckpt), '--tag', 'small', '--root', str(tmp_path / 'w'), '--no-full']) == 0
    config = json.loads((tmp_path / 'w' / 'ssog_ode_tiny_patch4_32.small' / 'config.json').read_text())
    assert config['pretrained_cfg']['input_size'] == [1, 16, 16]
    loaded = timm.create_model(f'local-dir:{tmp_path / "w" / "ssog_ode_tiny_patch4_32.small"}', pretrained=True)
    assert torch.equal(loaded.pos_embed, model.pos_embed)
    with pytest.raises(ValueError, match='img_size'):  # a size that does not fit the weights says which one does
        hub_main(['export', str(ckpt), '--tag', 'big', '--root', str(tmp_path / 'w'), '--no-full', '--img-size', '32'])


@pytest.mark.parametrize('arch', slow_except(['ssog_ode_tiny_patch4_32', 'looped_vit_tiny_patch4_32',
                                              'dense_vit_tiny_patch4_32'], fast=lambda a: a.startswith('looped')))
def test_export_keeps_the_depth_a_run_trained_at(arch, tmp_path):
    # a weight-shared trunk's depth shows in no tensor shape: exported at the default depth, it would load silently
    import argparse
    from timm_odevit_tools.hub.__main__ import main as hub_main
    torch.manual_seed(0)
    model = timm.create_model(arch, num_classes=10, in_chans=1, depth=3).eval()
    ckpt = tmp_path / 'last.pth.tar'
    args = argparse.Namespace(model=arch, model_kwargs={'depth': 3})
    torch.save({'arch': arch, 'state_dict': model.state_dict(), 'args': args}, ckpt)
    assert hub_main(['export', str(ckpt), '--tag', 'd3', '--root', str(tmp_path / 'w'), '--no-full']) == 0
    config = json.loads((tmp_path / 'w' / f'{arch}.d3' / 'config.json').read_text())
    assert config['model_args']['depth'] == 3
    loaded = timm.create_model(f'local-dir:{tmp_path / "w" / f"{arch}.d3"}', pretrained=True).eval()
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x), atol=1e-5) and loaded.nfe == model.nfe


def test_export_replaces_files_whole(tmp_path):
    """A re-export renames finished files into place: a reader that opened the old file keeps reading the old bytes
    whole (they still hash to the old manifest), and the new file hashes to the new manifest."""
    from timm_odevit_tools.hub.export import export
    from timm_odevit_tools.hub.verify import load_manifest
    root = tmp_path / 'weights'
    root.mkdir()
    model = timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10, in_chans=1)
    repo = export(model, 'ssog_ode_tiny_patch4_32', 'fmnist', str(root))
    key = f'{repo.name}/model.safetensors'
    old_sha = load_manifest(root)['files'][key]['sha256']
    with open(repo / 'model.safetensors', 'rb') as reader:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.)
        export(model, 'ssog_ode_tiny_patch4_32', 'fmnist', str(root))
        assert hashlib.sha256(reader.read()).hexdigest() == old_sha
    new_sha = load_manifest(root)['files'][key]['sha256']
    assert new_sha != old_sha and hashlib.sha256((repo / 'model.safetensors').read_bytes()).hexdigest() == new_sha
    assert sorted(p.name for p in root.iterdir()) == ['MANIFEST.json', repo.name]  # no staging folder left


def _run_checkpoint(run: Path, argv: List[str], record: Optional[Dict] = None) -> Path:
    """A last.pth.tar of the training command as its CheckpointSaver writes it (random weights, the parsed options),
    with the run's results.json record beside it."""
    from timm_odevit_tools.train import parse_args
    args = parse_args(argv)
    run.mkdir(parents=True)
    model = timm.create_model(args.model, num_classes=10, in_chans=1)
    torch.save({'arch': args.model, 'state_dict': model.state_dict(), 'args': args}, run / 'last.pth.tar')
    (run / 'results.json').write_text(json.dumps(record or {}))
    return run / 'last.pth.tar'


@pytest.mark.slow
def test_export_of_a_next_stage_states_every_stage(tmp_path, sample_first_100):
    """A run started from published weights (--initial-checkpoint) exports a card with each stage's recipe and command
    and the earlier weights named by hash; the budget adds the stages up and the matched table pairs twins whose
    stages are the same commands. Earlier weights missing or changed since the run started are refused; a checkpoint
    of the training command brings its own stages; weights of unknown provenance are said to be so."""
    from timm_odevit_tools.hub.__main__ import main as hub_main
    from timm_odevit_tools.hub.card import model_card
    from timm_odevit_tools.hub.export import run_stages
    from timm_odevit_tools.hub.record import weight_record
    from experiments.tables import matched_table, training_budget
    from timm_odevit.models.pretrained import fmnist_input
    from timm_odevit_tools.train import checkpoint_args, read_checkpoint
    root = tmp_path / 'weights'

    def export(ckpt: Path, tag: str = 'fmnist') -> int:
        return hub_main(['export', str(ckpt), '--tag', tag, '--root', str(root), '--no-full'])

    for arch in ('looped_ssog_tiny_patch4_32', 'looped_vit_tiny_patch4_32'):
        first = _run_checkpoint(tmp_path / arch / '1', ['--model', arch, '--epochs', '2', '--seed', '0'])
        assert export(first) == 0
        published = root / f'{arch}.fmnist' / 'model.safetensors'
        sha = hashlib.sha256(published.read_bytes()).hexdigest()
        second = _run_checkpoint(tmp_path / arch / '2', ['--model', arch, '--epochs', '3', '--lr', '5e-4', '--seed',
                                                         '0', '--initial-checkpoint', str(published)],
                                 {'initial_checkpoint_sha256': sha})
        assert export(second) == 0
        card = (root / f'{arch}.fmnist' / 'README.md').read_text()
        one, two = [stage['lines'] for stage in read_record(root / f'{arch}.fmnist')['stages']]
        assert one['schedule'].startswith('2 epochs, batch 64, adamw lr 0.001 ')
        assert two['schedule'].startswith('3 epochs, batch 64, adamw lr 0.0005 ')
        assert f'--initial-checkpoint {published}' in two['command'] and '--initial-checkpoint' not in one['command']
        # outside a git checkout no revision holds them: named by hash, said to be uncommitted
        assert two['initialised from'] == (f'`{published}`, sha256 {sha}, the published `{arch}.fmnist` weights '
                                           '(uncommitted: no revision holds them), which this export replaces')
        assert 'trained from scratch in 2 stages' in card
        assert training_budget(root / f'{arch}.fmnist') == '300k (5 epochs of 60,000)'
        assert read_record(root / f'{arch}.fmnist')['stages'][1]['initialised_from'] == {
            'weights': str(published), 'sha256': sha}
        set_top1(root / f'{arch}.fmnist', 50.0)  # the table compares full-test top-1 (exported with --no-full)
    rows = matched_table(root).splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith('| looped | `looped_ssog_tiny_patch4_32.fmnist` |'), rows

    # the path now holds the second stage's weights, not those the run started from
    with pytest.raises(ValueError, match=f'{published} changed after the run loaded it'):
        export(second, 'again')
    gone = tmp_path / 'gone.safetensors'
    shutil.copy(published, gone)
    ckpt = _run_checkpoint(tmp_path / 'gone', ['--model', arch, '--initial-checkpoint', str(gone)])
    gone.unlink()
    with pytest.raises(FileNotFoundError, match='the run loaded these weights'):
        export(ckpt, 'again')
    assert not (root / f'{arch}.again').exists()

    # from a checkpoint of the training command: its stages (here one) come first
    cfg = fmnist_input()
    args = checkpoint_args(read_checkpoint(str(_run_checkpoint(tmp_path / 'from_run', [
        '--model', arch, '--epochs', '4', '--initial-checkpoint', str(first)]))))
    one, two = run_stages(args, {}, cfg, root / f'{arch}.from_run')
    assert one['lines']['schedule'].startswith('2 epochs') and two['lines']['schedule'].startswith('4 epochs')
    assert two['lines']['initialised from'].endswith(', the last checkpoint of stage 1')
    assert (one['epochs'], two['epochs'], two['initialised_from'].get('repo')) == (2, 4, None)

    # from weights nobody recorded a recipe for: one stage, said to start from other weights
    foreign = tmp_path / 'foreign.safetensors'
    shutil.copy(published, foreign)
    args['initial_checkpoint'] = str(foreign)
    (only,) = run_stages(args, {}, cfg, root / f'{arch}.foreign')
    assert 'weights of unknown provenance' in only['lines']['initialised from']
    model = timm.create_model(arch, pretrained_cfg_overlay=cfg, num_classes=10, in_chans=1)
    description = model_card(weight_record(f'{arch}.foreign', model, [only]), {})['description']
    assert description.startswith(f'`{arch}` trained from other weights')


def test_card_description_names_the_stages_a_teacher_guided():
    """A weight a teacher joined late says which of its stages were guided; one guided throughout says only that."""
    from timm_odevit_tools.hub.card import model_card
    from timm_odevit_tools.hub.record import weight_record
    from timm_odevit.models.pretrained import fmnist_input
    arch = 'dense_vit_tiny_patch4_32'
    model = timm.create_model(arch, pretrained_cfg_overlay=fmnist_input(), num_classes=10, in_chans=1)
    teacher = {'teacher': {'model': 'resnet18', 'distill': 'logit'}, 'lines': {'schedule': '2 epochs'}}
    scratch = {'teacher': None, 'lines': {'schedule': '10 epochs'}}

    def description(stages):
        return model_card(weight_record(f'{arch}.fmnist', model, stages), {})['description']
    late = description([scratch, scratch, teacher, teacher])
    assert late.startswith(f'`{arch}` trained from scratch in 4 stages, each from the weights of the one before, '
                           'guided by a teacher (logit distillation) in stages 3, 4 on '), late
    throughout = description([teacher])
    assert throughout.startswith(f'`{arch}` trained from scratch, guided by a teacher (logit distillation) on ')
    # a weight guided by logits, then along the trajectory, names each kind with its stages
    trajectory = {'teacher': {'model': 'ssog_vit_tiny_patch4_32', 'distill': 'trajectory'}, 'lines': {}}
    mixed = description([scratch, scratch, teacher, teacher, trajectory, trajectory])
    assert 'guided by a teacher (logit distillation in stages 3, 4; trajectory distillation in stages 5, 6) on ' \
        in mixed, mixed


def test_training_budget_from_records(tmp_path):
    """The weights table's budget column adds up each stage of a weight's record, and refuses a record without
    one."""
    from experiments.tables import training_budget
    repo = tmp_path / 'x.fmnist'
    repo.mkdir()

    def record(*stages):
        (repo / RECORD_FILE).write_text(json.dumps({'format': 1, 'stages': [
            {'images_per_epoch': n, 'epochs': e} for n, e in stages]}))
    record((60000, 3), (60000, 8))
    assert training_budget(repo) == '660k (11 epochs of 60,000)'
    record((3000, 2), (1000, 5))
    assert training_budget(repo) == '11k (7 epochs in all)'
    record()
    with pytest.raises(ValueError, match='states no training stage'):
        training_budget(repo)
    (repo / RECORD_FILE).write_text('{"format": 1, "stages": [')
    with pytest.raises(ValueError, match='is not JSON'):
        training_budget(repo)


def test_weights_table_gives_an_ode_weights_top1_at_the_architectures_default_solver(tmp_path):
    """The weights table's top-1 is as pretrained=True solves it; an ODE weight trained on another grid than its
    architecture's default has its full-test top-1 at that default beside it, read from its record and model-index;
    others show '-'."""
    from experiments.tables import weights_table
    for name in ('dense_vit_tiny_patch4_32.fmnist', 'odevit_tiny_patch4_32.fmnist'):
        shutil.copytree(REPO_ROOT / 'weights' / name, tmp_path / name)
    ode = tmp_path / 'odevit_tiny_patch4_32.fmnist'
    edit_record(ode, lambda record: record.update(default_solver='euler:17'))
    set_top1(ode, 77.77, 'full', 'euler:17')
    dense, row = weights_table(tmp_path).splitlines()[2:]
    assert dense.endswith('| - |') and row.endswith('| 77.77% (17 steps) |'), (dense, row)


def test_matched_table_pairs_only_same_recipe(tmp_path):
    """An SSoG weight and its dense twin form a row only when one command (the model name aside) trained both, stage
    by stage."""
    from experiments.tables import matched_table, stage_commands, weight_facts
    ssog, dense = 'ssog_vit_tiny_patch4_32.fmnist', 'dense_vit_tiny_patch4_32.fmnist'
    for name in (dense, 'odevit_tiny_patch4_32.fmnist'):  # odevit's twin is absent: no row for it
        shutil.copytree(REPO_ROOT / 'weights' / name, tmp_path / name)
    # the SSoG twin's record from the dense one (every stage's command with its model name), whatever is published
    shutil.copytree(tmp_path / dense, tmp_path / ssog)
    assert edit_commands(tmp_path / ssog, dense.partition('.')[0], ssog.partition('.')[0]) >= 1
    set_top1(tmp_path / ssog, 91.23)
    assert len(stage_commands(tmp_path / dense)) >= 1 and weight_facts(tmp_path / ssog)['test'] == '91.23'
    gain = 91.23 - float(weight_facts(tmp_path / dense)['test'])
    rows = matched_table(tmp_path).splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith(f'| discrete | `{ssog}` |') and f'| {gain:+.2f} |' in rows[0], rows
    # a stage run on one thread beside another job is the same recipe (the threads are the machine's share)
    first = stage_commands(tmp_path / ssog)[0]
    threads = re.match(r'OMP_NUM_THREADS=\d+ ', first).group(0)
    assert edit_commands(tmp_path / ssog, first, first.replace(threads, 'OMP_NUM_THREADS=7 '), slice(0, 1)) == 1
    assert matched_table(tmp_path).splitlines()[2:] == rows
    assert edit_commands(tmp_path / dense, '--seed 0', '--seed 1') >= 1
    assert matched_table(tmp_path).splitlines()[2:] == []  # another seed: not a matched pair


def test_matched_table_pairs_ode_weights_started_from_their_looped_twins(tmp_path):
    """An ODE pair whose first stage trained each member's looped twin (the same function at the registered grid) is
    matched stage by stage: the SSoG stage names looped_ssog where the dense one names looped_vit; an SSoG ODE weight
    that started from another depth's SSoG weights is not."""
    from experiments.tables import matched_table
    dense = 'dense_vit_tiny_patch4_32'
    assert len(read_record(WEIGHTS / f'{dense}.fmnist')['stages']) >= 2
    # the multi-stage dense record made into odevit's: stage 1 trains looped_vit, the next odevit from its weights
    names = {'odevit_tiny_patch4_32.fmnist': ('looped_vit_', 'odevit_'),
             'ssog_ode_tiny_patch4_32.fmnist': ('looped_ssog_', 'ssog_ode_')}
    for name, (looped, ode) in names.items():
        shutil.copytree(WEIGHTS / f'{dense}.fmnist', tmp_path / name)
        assert edit_commands(tmp_path / name, f'--model {dense} ', f'--model {looped}tiny_patch4_32 ', slice(0, 1)) == 1
        edit_commands(tmp_path / name, f'{dense}.fmnist/', f'{looped}tiny_patch4_32.fmnist/')
        edit_commands(tmp_path / name, dense, f'{ode}tiny_patch4_32')
    rows = matched_table(tmp_path).splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith('| ode | `ssog_ode_tiny_patch4_32.fmnist` |'), rows
    edit_commands(tmp_path / 'ssog_ode_tiny_patch4_32.fmnist', 'looped_ssog_', 'ssog_vit_')
    assert matched_table(tmp_path).splitlines()[2:] == []


def test_matched_table_gives_an_ode_pair_at_the_architectures_default_solver_too(tmp_path):
    """An ODE pair trained on another grid than its architectures' default is compared at both: the grid both were
    trained on, which pretrained=True gives, and the default."""
    from experiments.tables import matched_table, weight_facts
    dense = tmp_path / 'odevit_tiny_patch4_32.fmnist'
    ssog = tmp_path / 'ssog_ode_tiny_patch4_32.fmnist'
    shutil.copytree(REPO_ROOT / 'weights' / dense.name, dense)
    shutil.copytree(dense, ssog)
    # the SSoG twin's earlier stages (if any) train looped_ssog where the dense ones train looped_vit
    edit_commands(ssog, '--model odevit_tiny_patch4_32 ', '--model ssog_ode_tiny_patch4_32 ')
    edit_commands(ssog, 'looped_vit_tiny_patch4_32', 'looped_ssog_tiny_patch4_32')
    edit_commands(ssog, f'weights/{dense.name}/', f'weights/{ssog.name}/')  # a stage that continues itself
    set_top1(ssog, 85.0, 'full', 'euler:12')
    set_top1(ssog, 90.0)
    rows = matched_table(tmp_path).splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith(f'| ode | `{ssog.name}` | 90.00% (12 steps: 85.00%) | '), rows
    facts = weight_facts(dense)  # against the published dense weight's two figures
    gains = 90. - float(facts['test']), 85. - float(facts['test_default_solver'])
    assert f'| {gains[0]:+.2f} (12 steps: {gains[1]:+.2f}) |' in rows[0], rows


def test_card_says_which_weights_a_run_with_an_ema_publishes():
    """A run that kept an EMA is published either with it or with its raw last-epoch weights; the card says which."""
    from timm_odevit_tools.hub.card import training_lines
    from timm_odevit.models.pretrained import FMNIST_CFG
    from timm_odevit_tools.train import parse_args
    args = vars(parse_args(['--model', 'odevit_tiny_patch4_32', '--model-ema']))
    assert training_lines(args, FMNIST_CFG)['schedule'].endswith('fp32, EMA weights')
    raw = training_lines(args, FMNIST_CFG, ema_published=False)['schedule']
    assert raw.endswith('fp32, an EMA kept but not published: these are the raw weights of the last epoch')
    args['model_ema'] = False
    assert training_lines(args, FMNIST_CFG)['schedule'].endswith('fp32')


def test_card_names_the_gpu_a_run_trained_on_and_the_threads_of_a_cpu_run():
    from timm_odevit_tools.hub.card import training_lines
    from timm_odevit.models.pretrained import FMNIST_CFG
    from timm_odevit_tools.train import parse_args
    gpu = vars(parse_args(['--model', 'ssog_vit_tiny_patch4_32', '--device', 'cuda', '--amp', 'bf16']))
    budget = training_lines(gpu, FMNIST_CFG, device_name='NVIDIA H200')['budget']
    assert budget.endswith('`cuda` (NVIDIA H200), bf16 autocast'), budget
    cpu = vars(parse_args(['--model', 'ssog_vit_tiny_patch4_32']))
    assert training_lines(cpu, FMNIST_CFG, threads=2, device_name='cpu')['budget'].endswith('2 CPU thread(s), fp32')


def test_guided_table_pairs_a_guided_weight_with_its_scratch_twin(tmp_path):
    """A weight trained with a teacher and one of the same architecture trained by the same command without the
    teacher's options form a row (guided minus scratch, as pretrained=True solves them and at the architecture's
    default solver); another seed is another recipe, not a row."""
    from experiments.tables import guided_table
    base = 'odevit_tiny_patch4_32'  # the published scratch student: no teacher in any of its stages
    scratch, guided = tmp_path / f'{base}.fmnist', tmp_path / f'{base}.fmnist_distilled'
    for repo, top1_full, top1_grid in ((scratch, 87.97, 88.10), (guided, 90.00, 90.50)):
        shutil.copytree(REPO_ROOT / 'weights' / f'{base}.fmnist', repo)
        set_top1(repo, top1_full)
        set_top1(repo, top1_grid, 'full', 'euler:12')
    assert edit_commands(guided, f'--model {base} ',
                         f'--model {base} --teacher ssog_vit_tiny_patch4_32 --state-norm layernorm ') >= 1
    edit_commands(guided, f'weights/{scratch.name}/', f'weights/{guided.name}/')  # a stage that continues itself
    rows = guided_table(tmp_path).splitlines()[2:]
    assert len(rows) == 1, rows
    assert rows[0].startswith(f'| `{base}` | `ssog_vit_tiny_patch4_32` | `{scratch.name}` | 87.97% (12 steps: 88.10%) '
                              f'| `{guided.name}` | 90.00% (12 steps: 90.50%) | +2.03 (12 steps: +2.40) | > +10 |')
    edit_commands(guided, '--seed 0', '--seed 1')
    assert guided_table(tmp_path).splitlines()[2:] == []


def test_guided_table_pairs_weights_continued_from_the_same_earlier_stage(tmp_path):
    """A guided weight continued from earlier weights pairs with the scratch weight continued from the same ones by
    the same last-stage command without the teacher; an earlier stage trained otherwise is not a pair."""
    from experiments.tables import guided_table, stage_commands
    base = 'odevit_tiny_patch4_32'  # the published scratch student: stages continued, no teacher in the last
    scratch, guided = tmp_path / f'{base}.fmnist', tmp_path / f'{base}.fmnist_distilled'
    shutil.copytree(REPO_ROOT / 'weights' / scratch.name, scratch)
    shutil.copytree(scratch, guided)
    last = stage_commands(scratch)[-1]
    assert len(stage_commands(scratch)) >= 2 and '--initial-checkpoint' in last and '--teacher' not in last
    assert edit_commands(guided, f'--model {base} ', f'--model {base} --teacher ssog_vit_tiny_patch4_32 ',
                         slice(-1, None)) == 1
    edit_commands(guided, f'weights/{scratch.name}/', f'weights/{guided.name}/')  # a stage that continues itself
    rows = guided_table(tmp_path).splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith(f'| `{base}` | `ssog_vit_tiny_patch4_32` | `{scratch.name}` |'), rows
    # logit KD alone guided no trajectory: a teacher made so is not a row of the guided table
    trajectory = read_record(guided)
    edit_commands(guided, '--teacher ssog_vit_tiny_patch4_32 ', '--teacher resnet18 --distill logit ')
    assert guided_table(tmp_path).splitlines()[2:] == []
    (guided / RECORD_FILE).write_text(json.dumps(trajectory))
    assert edit_commands(guided, '--seed 0', '--seed 1', slice(0, 1)) == 1
    assert guided_table(tmp_path).splitlines()[2:] == []


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(['git', '-C', str(repo), *args], capture_output=True, text=True, check=True)


def _checkout(path: Path) -> Path:
    path.mkdir(parents=True)
    _git(path, 'init', '-q')
    for key, value in (('user.name', 'test'), ('user.email', 'test@example.com'), ('commit.gpgsign', 'false')):
        _git(path, 'config', key, value)
    return path


def _commit(checkout: Path, message: str) -> str:
    _git(checkout, 'add', '-A')
    _git(checkout, 'commit', '-q', '-m', message)
    return _git(checkout, 'rev-parse', 'HEAD').stdout.strip()


@pytest.mark.skipif(shutil.which('git') is None, reason='needs git')
def test_a_weight_trained_again_leaves_the_version_before_loadable_at_its_revision(tmp_path):
    """Published weights are immutable: each commit of a folder is a revision. Exporting over weights no commit
    keeps is refused; a committed version stays loadable at its revision (the mirror serves it from history, checked
    against that commit's manifest, and timm loads it as hf-hub:<org>/<repo>@<revision>); a run's start weights and
    teacher are named by repo and revision; unknown, predating and inconsistent revisions are refused, naming why."""
    from timm_odevit_tools.hub.export import export, export_checkpoint, run_stages
    from timm_odevit_tools.hub.revisions import (RevisionError, check_replaceable, files_at, published_revision,
                                                 revision_log, weights_source)
    from timm_odevit.models.pretrained import fmnist_input
    from timm_odevit_tools.train import checkpoint_args, read_checkpoint
    from safetensors.torch import load as load_bytes
    checkout = _checkout(tmp_path / 'checkout')
    (checkout / 'notes.txt').write_text('before any weight\n')
    before = _commit(checkout, 'no weights yet')
    root = checkout / 'weights'
    model = timm.create_model(ARCH, num_classes=10, in_chans=1)
    folder = export(model, ARCH, 'fmnist', str(root))
    name, weights = folder.name, folder / 'model.safetensors'
    first_bytes = weights.read_bytes()
    with pytest.raises(ValueError, match='no commit keeps'):  # never committed: an export over it would lose it
        check_replaceable(folder)
    assert published_revision(folder) is None and weights_source(str(weights))['sha256']
    first = _commit(checkout, 'first version')
    assert published_revision(folder) == first and [e['commit'] for e in revision_log(folder)] == [first]
    check_replaceable(folder)
    assert weights_source(str(weights)) == {'weights': str(weights), 'repo': name, 'revision': first}

    # a run continued from the published weights and guided by them: both named by repo and revision
    ckpt = _run_checkpoint(tmp_path / 'run', ['--model', ARCH, '--epochs', '1', '--initial-checkpoint', str(weights),
                                              '--teacher', ARCH, '--teacher-checkpoint', str(weights)],
                           {'initial_checkpoint_sha256': sha256_file(weights)})
    (stage,) = run_stages(checkpoint_args(read_checkpoint(str(ckpt))), {}, fmnist_input(), folder)[-1:]
    assert stage['initialised_from'] == {'weights': str(weights), 'repo': name, 'revision': first}
    assert stage['teacher']['repo'] == name and stage['teacher']['revision'] == first
    assert f'`hf-hub:{ORG}/{name}@{first}`, which this export replaces (still loadable at that revision)' in \
        stage['lines']['initialised from']
    assert f'at revision {first}' in stage['lines']['teacher guidance']
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    export(model, ARCH, 'fmnist', str(root))
    with pytest.raises(ValueError, match='no commit keeps'):  # the export's own refusal, before measuring
        export_checkpoint(str(ckpt), 'fmnist', str(root), full_test=False)
    second = _commit(checkout, 'trained again')
    assert published_revision(folder) == second and [e['commit'] for e in revision_log(folder)] == [second, first]
    # the folder checked out at its first revision (to export a run that started there): named by that revision
    _git(checkout, 'checkout', first, '--', f'weights/{name}')
    assert published_revision(folder) == first and weights.read_bytes() == first_bytes
    check_replaceable(folder)  # the weights it holds stay at that revision
    assert weights_source(str(weights)) == {'weights': str(weights), 'repo': name, 'revision': first}
    _git(checkout, 'checkout', 'HEAD', '--', f'weights/{name}')
    assert files_at(root, name, first)['model.safetensors'] == first_bytes
    assert files_at(root, name, second[:12])['model.safetensors'] == weights.read_bytes() != first_bytes
    with pytest.raises(RevisionError, match='not in the git history'):
        files_at(root, name, 'f' * 40)
    with pytest.raises(RevisionError, match='not a revision name'):
        files_at(root, name, '--output=x')
    with pytest.raises(RevisionError, match='has no files at revision'):
        files_at(root, name, before)
    weights.write_bytes(first_bytes)  # committed without rewriting the manifest: that revision is inconsistent
    broken = _commit(checkout, 'weights without their manifest')
    with pytest.raises(RevisionError, match='does not hash to its MANIFEST.json entry'):
        files_at(root, name, broken)
    _git(checkout, 'revert', '--no-edit', 'HEAD')

    with HubMirror(str(root)) as mirror:
        status, head, _ = _request(f'{mirror.url}/{ORG}/{name}/resolve/main/config.json', 'HEAD')
        assert status == 200 and head['X-Repo-Commit'] == published_revision(folder)
        status, head, body = _request(f'{mirror.url}/{ORG}/{name}/resolve/{first}/model.safetensors')
        assert (status, head['X-Repo-Commit'], body) == (200, first, first_bytes)
        status, head, _ = _request(f'{mirror.url}/{ORG}/{name}/resolve/{broken}/model.safetensors', 'HEAD')
        assert (status, head['X-Error-Code']) == (404, 'RevisionNotFound')
        out = tmp_path / 'old.pt'
        done = run_client(mirror.url, tmp_path / 'hf', f'hf-hub:{ORG}/{name}@{first}', out)
        assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(out)
    old = timm.create_model(ARCH, num_classes=10, in_chans=1)
    old.load_state_dict(load_bytes(first_bytes))
    with torch.no_grad():
        assert torch.allclose(old.eval()(got['x']), got['y'], atol=1e-5)


def test_the_guiding_teacher_is_the_last_guided_stages(tmp_path):
    """A continued weight's record can name a teacher per stage (a CNN's logit KD, then the trajectory's teacher):
    the teacher and target times that the trajectory is measured with are those of the last guided stage."""
    from experiments.tables import guiding_teacher, teacher_target_times
    cnn = {'model': 'resnet18', 'weights': 't/cnn.pth.tar', 'sha256': 'a' * 64, 'distill': 'logit', 'times': None}
    vit = {'model': 'vit', 'weights': 'weights/vit.fmnist/model.safetensors', 'repo': 'vit.fmnist',
           'revision': 'b' * 40, 'distill': 'trajectory', 'times': [1.5, 3]}

    def record(*teachers):
        (tmp_path / RECORD_FILE).write_text(json.dumps({'format': 1, 'stages': [{'teacher': t} for t in teachers]}))
    record(cnn, vit)
    assert guiding_teacher(tmp_path) == vit and teacher_target_times(tmp_path) == [1.5, 3.0]
    record(None, dict(vit, revision='c' * 40, times=[2.0]), None)
    assert guiding_teacher(tmp_path)['revision'] == 'c' * 40 and teacher_target_times(tmp_path) == [2.0]
    record(None)
    assert guiding_teacher(tmp_path) == {}
    record(dict(vit, times=None))
    with pytest.raises(ValueError, match='states no student times'):
        teacher_target_times(tmp_path)


def test_trajectory_of_the_published_students(tmp_path, monkeypatch):
    """hub trajectory reads each guided pair from the published files alone (the record's commands, target times and
    teacher): the guided student relates the images as its teacher, loaded at the revision its record names, does,
    its scratch twin does not; other weights laid out under --teacher-root are what it then measures against; a
    revision the checkout lacks, a missing teacher, a record without times and a folder without a pair are each
    refused, naming what is wrong."""
    from safetensors.torch import save_file
    from experiments.tables import guiding_teacher, teacher_target_times
    from experiments.study.guidance import write_weights_trajectory
    from timm_odevit_tools.hub.revisions import RevisionError, resolve_revision
    monkeypatch.chdir(REPO_ROOT)  # the guided record names its teacher's weights relative to the repository
    names = ('odevit_tiny_patch4_32.fmnist', 'odevit_tiny_patch4_32.fmnist_distilled')
    for name in names:
        shutil.copytree(REPO_ROOT / 'weights' / name, tmp_path / 'weights' / name)
    card = tmp_path / 'weights' / names[1] / 'README.md'
    teacher = guiding_teacher(card.parent)
    assert teacher['repo'] == 'ssog_vit_tiny_patch4_32.fmnist' and 'sha256' not in teacher
    try:
        resolve_revision(WEIGHTS, teacher['revision'])
    except RevisionError:
        pytest.skip(f'this checkout lacks revision {teacher["revision"]} of the teacher (a shallow clone; a clone '
                    'without --depth has it)')
    # by default the teacher that guided the student: its revision, from git history
    table = write_weights_trajectory(tmp_path / 'weights', tmp_path / 'out', test_samples=8,
                                     data_dir=str(fm.SAMPLE_DIR))
    times = teacher_target_times(tmp_path / 'weights' / names[1])
    assert len(times) == 12 and times[-1] == 12.0
    rows = (tmp_path / 'out' / 'trajectory.csv').read_text().splitlines()
    assert rows[0] == 'student,teacher,arm,weights,distance,images,time,gap' and len(rows) == 1 + 2 * 2 * len(times)
    gaps = {(arm, distance): [float(r.split(',')[-1]) for r in rows[1:] if f',{arm},' in r and f',{distance},' in r]
            for arm in ('scratch', 'guided') for distance in ('cosine', 'gram')}
    assert all(len(g) == len(times) for g in gaps.values()), gaps
    # the guided student relates the images as its teacher does, its scratch twin does not (in any basis)
    # 0.51x after both students' solver-robust epoch (0.5x and below before it)
    assert sum(gaps['guided', 'gram']) < 0.6 * sum(gaps['scratch', 'gram']), gaps
    assert min(gaps['scratch', 'cosine']) > 0.5, gaps  # and the scratch twin's states are far from the teacher's
    assert f'`{names[1]}`' in table and 'first 8 Fashion-MNIST' in table
    # other weights laid out under --teacher-root are what the students are then measured against
    other = tmp_path / 'teacher_root'
    (other / teacher['weights']).parent.mkdir(parents=True)
    save_file(timm.create_model('ssog_vit_tiny_patch4_32', in_chans=1, num_classes=10).state_dict(),
              other / teacher['weights'])
    write_weights_trajectory(tmp_path / 'weights', tmp_path / 'other', test_samples=8, data_dir=str(fm.SAMPLE_DIR),
                             teacher_root=other)
    rows = (tmp_path / 'other' / 'trajectory.csv').read_text().splitlines()[1:]
    random_gram = sum(float(r.split(',')[-1]) for r in rows if ',guided,' in r and ',gram,' in r)
    assert random_gram > 2 * sum(gaps['guided', 'gram']), (random_gram, gaps)
    with pytest.raises(FileNotFoundError, match='pass that as --teacher-root'):
        write_weights_trajectory(tmp_path / 'weights', tmp_path / 'out', test_samples=8, data_dir=str(fm.SAMPLE_DIR),
                                 teacher_root=tmp_path)
    edit_record(card.parent, lambda record: record['stages'][-1]['teacher'].update(revision='f' * 40))
    with pytest.raises(RevisionError, match=f'Revision {"f" * 40} is not in'):
        write_weights_trajectory(tmp_path / 'weights', tmp_path / 'out', test_samples=8, data_dir=str(fm.SAMPLE_DIR))
    edit_record(card.parent, lambda record: record['stages'][-1]['teacher'].update(dict(teacher, times=None)))
    with pytest.raises(ValueError, match='states no student times'):
        write_weights_trajectory(tmp_path / 'weights', tmp_path / 'out', test_samples=8, data_dir=str(fm.SAMPLE_DIR))
    shutil.rmtree(tmp_path / 'weights' / names[0])
    with pytest.raises(FileNotFoundError, match='No guided weight'):
        write_weights_trajectory(tmp_path / 'weights', tmp_path / 'out', test_samples=8, data_dir=str(fm.SAMPLE_DIR))


def test_steered_table_needs_all_three_runs_trained_alike(tmp_path):
    """The three-way table (dense, fixed, steered) compares finished training runs, a row only when one command
    (the model name aside) trained all three, each scored by its EMA top-1 on the validation images."""
    from experiments.tables import steered_table
    logs, names = tmp_path / 'logs', ('dense_vit', 'ssog_vit', 'ssog_vit_steer')
    runs = [logs / f'{n}_tiny_patch4_32.fmnist' for n in names]
    for run in runs:
        shutil.copytree(REPO_ROOT / 'results' / 'weights' / run.name, run)
    top1 = [json.loads((r / 'results.json').read_text())['ema_top1'] for r in runs]
    rows = steered_table(logs, tmp_path / 'no-weights').splitlines()[2:]
    assert len(rows) == 1, rows
    cells = [c.strip() for c in rows[0].split('|')[1:-1]]
    assert cells[:2] == ['discrete', '2000'] and cells[-1] == 'none', cells
    assert [c.split()[:2] for c in cells[2:5]] == [[f'`{r.name}`', f'{t:.2f}%'] for r, t in zip(runs, top1)], cells
    assert cells[5].startswith(f'{top1[2] - top1[1]:+.2f} ') and cells[6].startswith(f'{top1[2] - top1[0]:+.2f} ')
    published = steered_table(logs, REPO_ROOT / 'weights').splitlines()[2].split('|')[-2]
    assert '`ssog_vit_tiny_patch4_32.fmnist`' in published and 'steer' not in published, published
    # a published weight continued by a later stage is no longer the run's: its cell says so
    weights, ssog = tmp_path / 'weights', 'ssog_vit_tiny_patch4_32.fmnist'
    shutil.copytree(REPO_ROOT / 'weights' / ssog, weights / ssog)
    stages = len(read_record(weights / ssog)['stages'])  # the published weight may have later stages already
    edit_record(weights / ssog, lambda record: record['stages'].append(record['stages'][0]))
    published = steered_table(logs, weights).splitlines()[2].split('|')[-2]
    assert re.fullmatch(rf' `ssog_vit_tiny_patch4_32.fmnist` [\d.]+% \(after {stages + 1} stages\) ', published), \
        published
    command = runs[2] / 'command.txt'
    command.write_text(command.read_text().replace('--seed 0', '--seed 1'))
    assert steered_table(logs, tmp_path).splitlines()[2:] == []  # another seed: not the same budget
    command.write_text(command.read_text().replace('--seed 1', '--seed 0'))
    (runs[0] / 'results.json').unlink()
    assert steered_table(logs, tmp_path).splitlines()[2:] == []  # the dense twin did not finish: no row


def test_learning_curves_from_run_logs(tmp_path):
    """The learning-curve table reads each run's summary.csv and the validation size from its command, recorded
    wherever the run ran; a run without results.json is marked unfinished, with the epochs it has trained."""
    from experiments.tables import learning_curves
    run = tmp_path / 'dense_vit_tiny_patch4_32.fmnist'
    run.mkdir()
    # recorded on another machine: its data folder is not here, which must not matter for reading the command
    (run / 'command.txt').write_text('OMP_NUM_THREADS=2 python -m timm_odevit_tools.train '
                                     '--model dense_vit_tiny_patch4_32 '
                                     f'--epochs 4 --val-samples 500 --data-dir {tmp_path / "gone"}\n')
    (run / 'summary.csv').write_text('epoch,train_loss,eval_top1,eval_ema_top1\n0,1.5,61.26,20.0\n1,1.1,70.04,44.96\n')
    (tmp_path / 'empty').mkdir()  # a folder without a summary is not a run
    want = '| `dense_vit_tiny_patch4_32.fmnist` | 500 | 61.3, 70.0{} | 45.0 |'
    assert learning_curves(tmp_path).splitlines()[2:] == [want.format(' (unfinished: 2 of 4 epochs)')]
    (run / 'results.json').write_text('{}')
    assert learning_curves(tmp_path).splitlines()[2:] == [want.format('')]


def test_elasticity_of_published_ode_weights(tmp_path):
    """hub elasticity solves every published ODE weight (loaded with local-dir:, as timm does) at each solver and
    leaves the discrete weights out; NFE follows the method (RK4: 4 evaluations a step)."""
    from timm_odevit_tools.hub.export import export
    from experiments.study.elasticity import write_weights_elasticity
    root = tmp_path / 'weights'
    for arch in ('odevit_tiny_patch4_32', 'dense_vit_tiny_patch4_32'):
        export(timm.create_model(arch, num_classes=10, in_chans=1, depth=2), arch, 'fmnist', str(root))
    table = write_weights_elasticity(root, tmp_path / 'out', ['euler:3', 'rk4:2'], test_samples=16,
                                     data_dir=str(fm.SAMPLE_DIR))
    rows = (tmp_path / 'out' / 'elasticity.csv').read_text().splitlines()
    assert rows[0] == 'model,seed,method,steps,nfe,images,top1' and len(rows) == 3
    assert [r.split(',')[:5] for r in rows[1:]] == [['odevit_tiny_patch4_32.fmnist', '', 'euler', '3', '3'],
                                                     ['odevit_tiny_patch4_32.fmnist', '', 'rk4', '2', '8']]
    assert '| NFE | | 3 | 8 |' in table and 'first 16 Fashion-MNIST' in table
    assert (tmp_path / 'out' / 'elasticity.png').is_file()


def test_elasticity_takes_midpoint_and_dopri5_with_the_nfe_it_spent(tmp_path):
    """An adaptive solver is named alone ('dopri5', at rtol 1e-3, atol 1e-4) and its column gives the NFE it took."""
    from timm_odevit_tools.hub.export import export
    from experiments.study.elasticity import write_weights_elasticity
    root = tmp_path / 'weights'
    export(timm.create_model('ssog_ode_tiny_patch4_32', num_classes=10, in_chans=1, depth=2), 'ssog_ode_tiny_patch4_32',
           'fmnist', str(root))
    table = write_weights_elasticity(root, tmp_path / 'out', ['midpoint:2', 'dopri5'], test_samples=8,
                                     data_dir=str(fm.SAMPLE_DIR))
    assert '| model | seed | midpoint 2 | dopri5 |' in table
    nfe = table.splitlines()[2].split('|')
    assert nfe[3].strip() == '4' and int(nfe[4].strip()) >= 6  # dopri5: 6 stages a step, at least one step


def test_elasticity_solves_looped_weights_as_their_ode_twin(tmp_path):
    """--looped-as-ode adds a row per published looped weight, solved as the ODE architecture with its parameters:
    at the registered grid (h = 1) it is the looped model's top-1 exactly; --only without the option would drop that
    row from the last table, and says so instead."""
    from timm_odevit_tools.evaluate import evaluate
    from experiments.study.elasticity import write_weights_elasticity
    root, out, looped = tmp_path / 'weights', tmp_path / 'out', 'looped_vit_tiny_patch4_32.fmnist'
    shutil.copytree(REPO_ROOT / 'weights' / looped, root / looped)
    kw = dict(test_samples=64, data_dir=str(fm.SAMPLE_DIR))
    with pytest.raises(FileNotFoundError, match='No ODE weights'):
        write_weights_elasticity(root, out, ['euler:12'], **kw)
    table = write_weights_elasticity(root, out, ['euler:12', 'euler:6'], looped_as_ode=True, **kw)
    rows = [r.split(',') for r in (out / 'elasticity.csv').read_text().splitlines()[1:]]
    name = f'{looped} as odevit_tiny_patch4_32'
    assert [r[:5] for r in rows] == [[name, '', 'euler', '12', '12'], [name, '', 'euler', '6', '6']]
    model = timm.create_model(f'local-dir:{root / looped}', pretrained=True)
    want = evaluate(model, fm.load_tensors(fm.SAMPLE_DIR, 'test', model=model, limit=64))['top1']
    assert rows[0][5] == '64' and float(rows[0][6]) == round(want, 2) > 50 and f'| `{name}` |' in table
    export_ode = timm.create_model('odevit_tiny_patch4_32', num_classes=10, in_chans=1, depth=2)
    from timm_odevit_tools.hub.export import export
    export(export_ode, 'odevit_tiny_patch4_32', 'fmnist', str(root))
    write_weights_elasticity(root, out, ['euler:12', 'euler:6'], looped_as_ode=True, **kw)
    with pytest.raises(ValueError, match=f'would lose \\({name}\\).*--looped-as-ode'):
        write_weights_elasticity(root, out, ['euler:12', 'euler:6'], only=['odevit_tiny_patch4_32.fmnist'], **kw)
    write_weights_elasticity(root, out, ['euler:12', 'euler:6'], only=['odevit_tiny_patch4_32.fmnist'],
                             looped_as_ode=True, **kw)
    assert [r.split(',')[0] for r in (out / 'elasticity.csv').read_text().splitlines()[1:]] == [
        'odevit_tiny_patch4_32.fmnist'] * 2 + [name] * 2


def test_elasticity_only_remeasures_the_named_weights_and_keeps_the_rest(tmp_path):
    """--only measures the named weights and keeps every other weight's rows from the last table, in folder order;
    it refuses a name that is not an ODE weight and a last table at other solvers or on another number of images."""
    from timm_odevit_tools.hub.export import export
    from experiments.study.elasticity import write_weights_elasticity
    root, out = tmp_path / 'weights', tmp_path / 'out'
    archs = ('odevit_tiny_patch4_32', 'ssog_ode_tiny_patch4_32')
    for arch in archs:
        export(timm.create_model(arch, num_classes=10, in_chans=1, depth=2), arch, 'fmnist', str(root))
    kw = dict(test_samples=16, data_dir=str(fm.SAMPLE_DIR))
    with pytest.raises(ValueError, match='no earlier elasticity.csv'):
        write_weights_elasticity(root, out, ['euler:3'], only=[f'{archs[1]}.fmnist'], **kw)
    write_weights_elasticity(root, out, ['euler:3', 'rk4:2'], **kw)
    before = (out / 'elasticity.csv').read_text().splitlines()
    # marks in the last table: the named weight's rows must be measured again, the others' kept as they are
    marked = [r.rsplit(',', 1)[0] + (',-1.0' if i < 3 else ',99.0') for i, r in enumerate(before) if i]
    (out / 'elasticity.csv').write_text('\n'.join([before[0], *marked]) + '\n')
    table = write_weights_elasticity(root, out, ['euler:3', 'rk4:2'], only=[f'{archs[0]}.fmnist'], **kw)
    after = (out / 'elasticity.csv').read_text().splitlines()
    assert [r.split(',')[:5] for r in after] == [r.split(',')[:5] for r in before]  # same rows, same order
    assert [r.rsplit(',', 1)[1] for r in after[1:]] == [r.rsplit(',', 1)[1] for r in before[1:3]] + ['99.0', '99.0']
    assert '| `ssog_ode_tiny_patch4_32.fmnist` |  | 99.00 | 99.00 |' in table
    with pytest.raises(ValueError, match='--only dense_vit_tiny_patch4_32.fmnist: no such ODE weight'):
        write_weights_elasticity(root, out, ['euler:3', 'rk4:2'], only=['dense_vit_tiny_patch4_32.fmnist'], **kw)
    with pytest.raises(ValueError, match=r"not at \[\('euler', 3\)\]"):
        write_weights_elasticity(root, out, ['euler:3'], only=[f'{archs[0]}.fmnist'], **kw)
    with pytest.raises(ValueError, match='measured on 16 test images, not 8'):
        write_weights_elasticity(root, out, ['euler:3', 'rk4:2'], only=[f'{archs[0]}.fmnist'], test_samples=8,
                                 data_dir=str(fm.SAMPLE_DIR))


@pytest.mark.slow
def test_elasticity_jobs_measures_each_weight_in_a_process_of_its_own(tmp_path, monkeypatch):
    """--jobs 2 measures the weights in worker processes (the calling one loads none) and gives the table, csv and
    row order that one process gives; fewer than one job is refused."""
    from timm_odevit_tools.hub.export import export
    import experiments.study.elasticity as elasticity
    root = tmp_path / 'weights'
    for arch in ('odevit_tiny_patch4_32', 'ssog_ode_tiny_patch4_32'):
        export(timm.create_model(arch, num_classes=10, in_chans=1, depth=2), arch, 'fmnist', str(root))
    kw = dict(test_samples=16, data_dir=str(fm.SAMPLE_DIR))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the two workers gets on 2 cores: the same sums, the same argmax on ties
    try:
        one = elasticity.write_weights_elasticity(root, tmp_path / 'one', ['euler:3', 'rk4:2'], **kw)
    finally:
        torch.set_num_threads(threads)

    def load_here(name, *_):
        raise AssertionError(f'{name} was loaded in the calling process')
    monkeypatch.setattr(elasticity, '_load_weight', load_here)
    monkeypatch.setattr(torch, 'get_num_threads', lambda: 2)
    two = elasticity.write_weights_elasticity(root, tmp_path / 'two', ['euler:3', 'rk4:2'], jobs=2, **kw)
    assert two == one and '| `ssog_ode_tiny_patch4_32.fmnist` |' in two
    assert (tmp_path / 'two' / 'elasticity.csv').read_text() == (tmp_path / 'one' / 'elasticity.csv').read_text()
    with pytest.raises(ValueError, match='jobs=0'):
        elasticity.write_weights_elasticity(root, tmp_path / 'two', ['euler:3'], jobs=0, **kw)
