"""The check mode of the shell commands in README.md and docs/ (tests/test_doc_commands.py).

A block marked ``<!-- commands: check: REASON -->`` (hours of training, a GPU, timm's scripts from a clone, a
command that rewrites committed files) runs in the real bash, as written: loops, variables and quoting as the shell
does them. Only ``python``, ``python3``, ``torchrun``, ``pip``, ``bash`` and ``git`` are shims that call this file,
which checks each call instead of running it (``git show`` does run: it only reads): our commands' arguments go
through their own parsers (the training command's option ranges and model names included), every committed file a
command names exists, timm's scripts get registered model names and existing config files, pip installs what CI
installs, a bash script parses. It exits non-zero, saying why, on the first problem.

    python tests/doc_commands.py PROGRAM ARGS...
"""
import argparse
import os
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, NoReturn, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIMS = ('python', 'python3', 'torchrun', 'pip', 'bash', 'git')
# committed inputs: a command naming one that is missing would fail for every reader (results/ and output/ hold what
# an earlier command of the same page writes)
COMMITTED = ('weights/', 'examples/', 'benchmarks/', 'tests/')
TIMM_SCRIPTS = ('train.py', 'validate.py')  # timm's own, from a clone of pytorch-image-models: not in this repo


def fail(message: str) -> NoReturn:
    raise SystemExit(f'doc command check: {message}')


class _Parsed(Exception):
    pass


def parse_only(run: Callable[[], object], what: str) -> argparse.Namespace:
    """Run a command's entry point up to its first ``ArgumentParser.parse_args`` and stop there."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    try:
        run()
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    fail(f'{what} returned without parsing a command line')


def check_committed_files(args: Sequence[str]) -> None:
    for arg in args:
        for token in arg.replace('=', ' ').split():
            if token.startswith(COMMITTED) and not (Path.cwd() / token).exists():
                fail(f'{token}: no such file in the repository')


def check_training(args: List[str]) -> None:
    from timm_odevit_tools.train.command import parse_args
    parse_args(args, files=False)


def check_guidance(ns: argparse.Namespace) -> None:
    from experiments.study.guidance import guidance_setup
    from timm_odevit_tools.train.command import parse_args
    guidance_setup(ns.student, ns.teacher, ns.guide, ns.model_kwargs, ns.train_options)
    guided = ['--model', ns.student, '--model-kwargs', *ns.model_kwargs, *shlex.split(ns.train_options),
              '--teacher', *shlex.split(ns.teacher), *shlex.split(ns.guide)]
    parse_args(guided, files=False)


def _published_hub_name(name: str) -> bool:
    """``hf-hub:<org>/<repo>[@<revision>]`` naming a folder of weights/ (and, with a revision, one of its commits
    that this clone holds; a shallow clone passes)."""
    from timm_odevit_tools.hub import ORG
    from timm_odevit_tools.hub.revisions import RevisionError, files_at
    repo, _, revision = name.partition('@')
    if not repo.startswith(f'hf-hub:{ORG}/') or not (REPO_ROOT / 'weights' / repo.split('/', 1)[1]).is_dir():
        return False
    try:
        return not revision or bool(files_at(REPO_ROOT / 'weights', repo.split('/', 1)[1], revision))
    except RevisionError:
        shallow = subprocess.run(['git', 'rev-parse', '--is-shallow-repository'], capture_output=True, text=True)
        return shallow.stdout.strip() == 'true'


def check_timm_script(script: str, args: List[str]) -> None:
    """timm's train.py / validate.py take hundreds of options; what can be wrong on our side is checked: the
    model name, the config file, the modules to import."""
    import timm
    import timm_odevit  # noqa: F401
    for flag, value in zip(args, args[1:]):
        if flag == '--model' and not (timm.is_model(value) or _published_hub_name(value)):
            fail(f'{script} --model {value}: not a registered model')
        if flag in ('-c', '--config'):
            import yaml
            cfg = yaml.safe_load((Path.cwd() / value).read_text())
            if not timm.is_model(cfg.get('model', '')):
                fail(f'{value}: model {cfg.get("model")!r} is not registered')
        if flag == '--device-modules':
            __import__(value)


def check_module(module: str, args: List[str]) -> None:
    if module == 'pytest':
        paths = [a.split('=', 1)[-1] for a in args if not a.startswith('-') or a.startswith('--ignore=')]
        for path in (p for p in paths if p.startswith('tests')):
            if not (Path.cwd() / path.split('::')[0]).exists():
                fail(f'pytest {path}: no such test path')
        return
    if not module.startswith(('timm_odevit', 'experiments')):
        fail(f'-m {module}: not a module of this project')
    sys.path.insert(0, os.getcwd())  # as python -m does: experiments/ is a folder of the checkout, not installed
    if module in ('timm_odevit_tools.train', 'timm_odevit.train'):
        return check_training(args)
    if module == 'timm_odevit.run':
        if not args or Path(args[0]).name not in TIMM_SCRIPTS:
            fail(f'the launcher runs timm\'s {" / ".join(TIMM_SCRIPTS)}, got {args[:1]}')
        return check_timm_script(args[0], args[1:])
    sys.argv = [module] + args
    ns = parse_only(lambda: runpy.run_module(module, run_name='__main__', alter_sys=True), f'python -m {module}')
    if module == 'experiments.study' and ns.cmd == 'guidance':
        check_guidance(ns)


def check_python(args: List[str]) -> None:
    if not args:
        fail('python without arguments')
    if args[0] == '-m':
        return check_module(args[1], args[2:])
    script = args[0]
    if Path(script).name in TIMM_SCRIPTS and not Path(script).exists():
        return check_timm_script(script, args[1:])
    if not Path(script).is_file():
        fail(f'{script}: no such script')
    sys.argv = list(args)
    sys.path.insert(0, str(Path(script).resolve().parent))
    parse_only(lambda: runpy.run_path(script, run_name='__main__'), script)


def check_pip(args: List[str]) -> None:
    ci = (REPO_ROOT / '.ci' / 'run').read_text()
    installs = [shlex.split(line)[1:] for line in ci.splitlines() if line.startswith('pip install')]
    if [a for a in args if a != '--quiet'] not in [[a for a in i if a != '--quiet'] for i in installs]:
        fail(f'pip {shlex.join(args)}: not what .ci/run installs')


def check_git(args: List[str]) -> None:
    """``git show REV:PATH`` (an earlier version of a file), run: a clone without that history (shallow) passes."""
    if args[:1] != ['show']:
        fail(f'git {shlex.join(args)}: only git show is documented')
    if subprocess.run(['git', *args]).returncode:
        shallow = subprocess.run(['git', 'rev-parse', '--is-shallow-repository'], capture_output=True, text=True)
        if shallow.stdout.strip() != 'true':
            fail(f'git {shlex.join(args)}: not in this repository\'s history')


def main(argv: List[str]) -> None:
    program, args = argv[0], [a for a in argv[1:] if a != '...']  # "..." stands for the options shown above it
    check_committed_files(args)
    if program in ('python', 'python3'):
        check_python(args)
    elif program == 'torchrun':
        check_python(args[next(i for i, a in enumerate(args) if a == '-m'):])
    elif program == 'pip':
        check_pip(args)
    elif program == 'bash':  # a script: its syntax, not its run
        if subprocess.run(['/bin/bash', '-n', args[0]]).returncode:
            fail(f'bash {args[0]}: syntax error')
    elif program == 'git':
        check_git(args)
    else:
        fail(f'{program}: no check for this program')


if __name__ == '__main__':
    if os.environ.get('DOC_CHECK_ACTIVE'):  # a shim reached from a check: the real program would loop back here
        fail('a checked command called another shimmed program')
    os.environ['DOC_CHECK_ACTIVE'] = '1'
    shims = os.environ.get('DOC_CHECK_SHIMS')  # this check's own programs (git, bash) are the real ones
    os.environ['PATH'] = os.pathsep.join(d for d in os.environ['PATH'].split(os.pathsep) if d != shims)
    os.environ.setdefault('TIMM_ODEVIT_AUTOLOAD', '0')
    main(sys.argv[1:])
