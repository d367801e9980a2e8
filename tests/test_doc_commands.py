"""Every shell command in README.md and docs/, run as written.

A ```bash block runs in bash from the repository root, with its own Hugging Face cache; it must exit 0, and a command
it starts in the background (``&``) must still be running a few seconds later (then it is stopped). A block preceded
by ``<!-- commands: check: REASON -->`` (hours of training, a GPU, timm's scripts from a clone, a command that
rewrites committed files) runs in the same bash, as written, with ``python``, ``torchrun``, ``pip``, ``bash`` and
``git`` replaced by tests/doc_commands.py, which checks each call's arguments with the command's own parser instead
of running it (``git show`` runs: it only reads; docs/testing.md)."""
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

import doc_commands

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [REPO_ROOT / 'README.md'] + sorted((REPO_ROOT / 'docs').glob('*.md'))
_BLOCK = re.compile(r'(?:^<!-- commands: check: (?P<why>[^>]+?) -->\n)?^```(?:bash|sh)\n(?P<body>.*?)^```$',
                    re.S | re.M)
# the README's mirror answers this once it is up (the default model's repository)
MIRROR_PROBE = '/api/models/timm-odevit/ssog_ode_small.fmnist_64px'
BACKGROUND_GRACE_S = 8
# seconds the mirror a block starts in the background may take to answer after the grace
PROBE_S = 60


class Block(NamedTuple):
    page: Path
    line: int
    body: str
    check_why: str

    @property
    def id(self) -> str:
        return f'{self.page.relative_to(REPO_ROOT).as_posix()}:{self.line}'


def blocks() -> List[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count('\n', 0, m.start('body'))
            found.append(Block(page, line, m['body'], m['why'] or ''))
    return found


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith('HF_')}
    env.update(HF_HOME=str(tmp_path / 'hf'), HF_HUB_DISABLE_TELEMETRY='1', PYTHONWARNINGS='ignore')
    env.update(extra)
    return env


def _shims(tmp_path: Path) -> Path:
    shim_dir = tmp_path / 'shims'
    shim_dir.mkdir()
    for name in doc_commands.SHIMS:
        shim = shim_dir / name
        shim.write_text(f'#!/bin/sh\n"{sys.executable}" "{doc_commands.__file__}" {name} "$@" '
                        f'|| {{ echo "{name} $*" >> "$DOC_CHECK_FAILURES"; exit 1; }}\n')
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return shim_dir


def run_checked(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The block in bash with the checking shims first on PATH; a failed call fails the block even when bash goes
    on past it (a loop, a background job)."""
    failures = tmp_path / 'failures.txt'
    failures.touch()
    shims = _shims(tmp_path)
    env = _env(tmp_path, PATH=f'{shims}{os.pathsep}{os.environ["PATH"]}', DOC_CHECK_SHIMS=str(shims),
               DOC_CHECK_FAILURES=str(failures))
    proc = subprocess.run(['/bin/bash', '-c', body + '\nwait\n'], env=env, capture_output=True, text=True,
                          timeout=600, cwd=str(REPO_ROOT))
    if failures.read_text().strip() and not proc.returncode:
        proc.returncode = 1
    proc.stderr += failures.read_text()
    return proc


def run_as_written(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    epilogue = ''
    if re.search(r'&\s*(#.*)?$', body, re.M):
        # the background jobs die however the block ends (a live server would hold the pipes open until the
        # timeout); a loaded machine may take longer than the grace to serve, so the probe retries for a minute
        epilogue = ('\nstarted=$(jobs -p)\ntrap \'kill $started 2>/dev/null || true\' EXIT\n'
                    f'sleep {BACKGROUND_GRACE_S}\n'
                    'for job in $started; do kill -0 "$job" 2>/dev/null || { echo "a background command ended" >&2;'
                    ' exit 97; }; done\n'
                    'if [ -n "${HF_ENDPOINT:-}" ]; then served=0; for i in $(seq ' f'{PROBE_S}); do '
                    f'"{sys.executable}" -c "import urllib.request as u; '
                    f'u.urlopen(\'$HF_ENDPOINT{MIRROR_PROBE}\', timeout=10)" 2>/dev/null && {{ served=1; break; }}; '
                    'sleep 1; done; [ $served = 1 ] || { echo "nothing answered at $HF_ENDPOINT" >&2; exit 98; }; fi\n'
                    'kill $started; wait\n')
    return subprocess.run(['/bin/bash', '-e', '-c', body + epilogue], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=600, cwd=str(REPO_ROOT))


@pytest.mark.slow
@pytest.mark.parametrize('block', blocks(), ids=lambda b: b.id)
def test_documented_commands_run_as_written(block, tmp_path):
    proc = (run_checked if block.check_why else run_as_written)(block.body, tmp_path)
    assert proc.returncode == 0, f'{block.id}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}'


def test_pages_have_commands_of_both_kinds():
    found = blocks()
    assert len(found) >= 25 and any(b.check_why for b in found) and any(not b.check_why for b in found)


@pytest.mark.parametrize('body,problem', [
    ('python -m timm_odevit_tools.train --model dense_vit_tiny_patch4_32 --lr=-1', '--lr must be'),
    ('python -m timm_odevit_tools.train --model dense_vit_tiny_patch4_32 --no-such-option', 'unrecognized arguments'),
    ('python -m timm_odevit_tools.train --model dense_vit_tiny --initial-checkpoint weights/nope/model.safetensors',
     'weights/nope/model.safetensors: no such file'),
    ('python -m timm_odevit_tools.hub verfy --root weights', "invalid choice: 'verfy'"),
    ('for m in odevit_tiny no_such_model; do python -m timm_odevit_tools.train --model $m & done',
     'timm knows no such'),
    ('python -m experiments.study guidance --teacher dense_vit_tiny --train-options "--epochs 3"', 'sets'),
    ('python -m timm_odevit.run validate.py --model no_such_model --pretrained', 'not a registered model'),
    ('python validate.py --model hf-hub:timm-odevit/no_such_model.fmnist --pretrained', 'not a registered model'),
    ('python train.py -c examples/no_such.yaml', 'no such file'),
    ('pip install torch .', 'not what .ci/run installs'),
])
def test_checked_commands_fail_on_a_wrong_command(body, problem, tmp_path):
    proc = run_checked(body, tmp_path)
    assert proc.returncode != 0 and problem in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_checked_commands_pass_a_right_one(tmp_path):
    body = ('for arch in dense_vit_tiny_patch4_32 ssog_vit_tiny_patch4_32; do\n'
            '    OMP_NUM_THREADS=1 python -m timm_odevit_tools.train --model $arch --initial-checkpoint '
            'weights/$arch.fmnist/model.safetensors --epochs 2 &\ndone\n'
            'python -m timm_odevit_tools.hub export results/x/last.pth.tar --tag fmnist --root weights\n')
    proc = run_checked(body, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_background_command_that_dies_fails_its_block(tmp_path):
    proc = run_as_written('python -c "import sys; sys.exit(3)" &\n', tmp_path)
    assert proc.returncode == 97


def test_a_background_server_that_never_answers_fails_its_block_and_is_stopped(tmp_path, monkeypatch):
    # a live job holding the block's pipes would keep the test until its timeout: it is killed however the block ends
    import test_doc_commands
    monkeypatch.setattr(test_doc_commands, 'PROBE_S', 2)
    proc = run_as_written('sleep 300 &\nexport HF_ENDPOINT=http://127.0.0.1:9\n', tmp_path)
    assert proc.returncode == 98 and 'nothing answered at http://127.0.0.1:9' in proc.stderr, proc.stderr[-2000:]
