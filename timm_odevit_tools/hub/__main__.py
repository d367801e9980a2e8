"""``python -m timm_odevit_tools.hub``: export, remeasure, manifest, verify, revisions, push, serve, evaluate, demo.

The tables and analyses of the published weights (table, elasticity, trajectory) are experiments:
``python -m experiments.weights`` from a checkout."""
import argparse
import difflib
import json
import logging
import sys
from pathlib import Path
from typing import List, Optional

from . import ORG
from ..cli import run_command

PROG = 'python -m timm_odevit_tools.hub'
SOLVER_TABLE_HELP = ('an ODE weight: its card also gives top-1 on the sample against the solver (Euler, midpoint and '
                     'RK4 at a quarter to once the training grid\'s NFE, Euler at twice it, dopri5)')


def evaluate_folder(folder: str, data: str = 'sample', solver: Optional[str] = None) -> dict:
    """Top-1 of the weights in ``folder`` (loaded with timm's ``local-dir:``) on the sample or the full test set;
    ``solver`` ('method:steps') solves an ODE model's trunk another way than its registered default."""
    import timm
    import timm_odevit  # noqa: F401  (registers the architectures config.json names)
    from .. import data as fm
    from ..evaluate import evaluate, parse_solver, solver_kwargs
    from timm_odevit.layers import ode_trunk
    sources = {'sample': fm.SAMPLE_DIR, 'full': fm.DEBIAN_FASHION_MNIST}
    if data not in sources and not Path(data).is_dir():
        near = difflib.get_close_matches(data, list(sources), n=1)
        raise ValueError(f'--data {data}: no such folder' + (f'; did you mean {near[0]!r}?' if near else '.')
                         + " Give 'sample' (the bundled 1,000 images), 'full' (the Fashion-MNIST test set) or a "
                           'folder of Fashion-MNIST IDX files.')
    src = sources.get(data, data)
    model = timm.create_model(f'local-dir:{Path(folder).resolve()}', pretrained=True)
    if solver:
        if ode_trunk(model) is None:
            raise ValueError(f'--solver needs an ODE model; {folder} holds a {type(model.trunk).__name__} trunk: '
                             'drop --solver.')
        model.trunk.set_solver(**solver_kwargs(*parse_solver(solver)))
    return evaluate(model, fm.load_tensors(src, 'test', model=model))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = p.add_subparsers(dest='cmd', required=True)

    e = sub.add_parser('export', help='export a checkpoint of python -m timm_odevit_tools.train to '
                                      '<root>/<arch>.<tag>/ and update the manifest')
    e.add_argument('checkpoint', help='e.g. output/train/<run>/last.pth.tar')
    e.add_argument('--tag', required=True, help='what the weights are, e.g. fmnist or fmnist_64px')
    e.add_argument('--arch', default=None, help="default: the checkpoint's --model")
    e.add_argument('--img-size', type=int, default=None, help='input size the exported config.json records '
                   "(default: the run's --model-kwargs img_size, else 32)")
    e.add_argument('--description', default=None, help='model card description')
    e.add_argument('--root', default='weights')
    e.add_argument('--use-ema', action='store_true')
    e.add_argument('--no-full', action='store_true', help='skip the full Fashion-MNIST test set')
    e.add_argument('--threads', type=int, default=None,
                   help='CPU threads the run trained on, for its card (default: what the run recorded, else 1)')
    e.add_argument('--dtype', choices=('float32', 'float16', 'bfloat16'), default='float32',
                   help='precision of the stored weights (half halves the file; the card measures what is stored)')
    e.add_argument('--solver-table', action='store_true', help=SOLVER_TABLE_HELP)

    r = sub.add_parser('remeasure', help="re-measure a published folder at the solver it was trained with and "
                                         "re-render its card (its recipe kept) and config.json; weights untouched")
    r.add_argument('folder', help='e.g. weights/ssog_ode_tiny_patch4_32.fmnist')
    r.add_argument('--no-full', action='store_true', help='skip the full Fashion-MNIST test set')
    r.add_argument('--solver-table', action=argparse.BooleanOptionalAction, default=None,
                   help=SOLVER_TABLE_HELP + '; --no-solver-table drops it (default: keep the card\'s)')

    m = sub.add_parser('manifest', help='rewrite <root>/MANIFEST.json from the files as they are')
    m.add_argument('--root', default='weights')

    v = sub.add_parser('verify', help='check every repo under --root (manifest, config, architecture, shapes)')
    v.add_argument('--root', default='weights')

    rv = sub.add_parser('revisions', help="the revisions of a published folder (the commits that changed it), "
                                          "each loadable as hf-hub:<org>/<repo>@<revision> from the mirror")
    rv.add_argument('folder', help='e.g. weights/ssog_vit_tiny_patch4_32.fmnist')

    u = sub.add_parser('push', help="push a folder with timm's push_to_hf_hub")
    u.add_argument('folder')
    u.add_argument('--repo-id', default=None, help=f'default: {ORG}/<folder name>')
    u.add_argument('--dry-run', action='store_true', help='show what would be sent; no network')
    u.add_argument('--private', action='store_true')

    s = sub.add_parser('serve', help='serve a folder of repos over the Hub download protocol on loopback')
    s.add_argument('--root', default=None,
                   help="folder of repos (default: ./weights where it is one, else the weights this install carries: "
                        "a checkout's weights/ or the bundled default model's)")
    s.add_argument('--port', type=int, default=8765)
    s.add_argument('--host', default='127.0.0.1')
    s.add_argument('--org', default=ORG)
    s.add_argument('--no-verify', action='store_true', help='serve files without manifest/config checks')
    s.add_argument('--duration', type=float, default=None, help='stop after this many seconds')

    ev = sub.add_parser('evaluate', help='top-1 of a weights folder on the bundled sample or the full test set')
    ev.add_argument('folder')
    ev.add_argument('--data', default='sample', help="'sample', 'full' or a folder of IDX files")
    ev.add_argument('--solver', default=None, help="ODE models: 'method:steps', e.g. euler:23 or rk4:6")

    d = sub.add_parser('demo', help='load a pretrained model through an in-process mirror and classify the sample')
    d.add_argument('--model', default=None)
    d.add_argument('--root', default=None)

    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.cmd == 'serve' else logging.WARNING, format='%(message)s')

    if a.cmd == 'export':
        import timm_odevit  # noqa: F401
        from timm_odevit.models.pretrained import fmnist_input
        from .export import STORAGE_DTYPES, export_checkpoint
        cfg = fmnist_input(a.img_size) if a.img_size else None
        print(json.dumps(export_checkpoint(a.checkpoint, a.tag, a.root, cfg, a.description, not a.no_full,
                                           a.use_ema, a.arch, a.threads, STORAGE_DTYPES[a.dtype],
                                           a.solver_table)))
    elif a.cmd == 'remeasure':
        import timm_odevit  # noqa: F401
        from .export import remeasure
        print(json.dumps(remeasure(a.folder, not a.no_full, a.solver_table)))
    elif a.cmd == 'manifest':
        from .verify import write_manifest
        print(write_manifest(Path(a.root)))
    elif a.cmd == 'verify':
        import timm_odevit  # noqa: F401
        from .verify import verify_root
        bad = 0
        for repo, errs in verify_root(Path(a.root)).items():
            print(f'{repo or a.root}: {"ok" if not errs else "FAILED"}')
            for err in errs:
                print(f'  {err}')
            bad += len(errs)
        return 1 if bad else 0
    elif a.cmd == 'revisions':
        from .revisions import published_revision, revision_log
        log = revision_log(Path(a.folder))
        if not log:
            print(f'error: {a.folder} has no committed weights (not a published folder of a git checkout, or its '
                  'weights were never committed)', file=sys.stderr)
            return 2
        current = published_revision(Path(a.folder))
        for entry in log:
            what = 'weights' if entry['weights'] else 'card   '
            mark = '  (main)' if entry['commit'] == current else ''
            print(f"{entry['commit']}  {entry['date']}  {what}  {entry['subject'][:60]}{mark}")
        print(f'load one as hf-hub:{ORG}/{Path(a.folder).resolve().name}@<revision> through the mirror '
              '(python -m timm_odevit_tools.hub serve)')
    elif a.cmd == 'push':
        import timm_odevit  # noqa: F401
        from .export import push
        print('\n'.join(push(a.folder, a.repo_id, a.dry_run, private=a.private)))
    elif a.cmd == 'serve':
        import timm_odevit  # noqa: F401  (the checks build models named in config.json)
        from .server import default_serve_root, serve
        try:
            serve(a.root or default_serve_root(), a.port, a.host, a.org, not a.no_verify, a.duration)
        except (OSError, ValueError) as e:
            print(f'error: {e}', file=sys.stderr)
            return 2
    elif a.cmd == 'evaluate':
        r = evaluate_folder(a.folder, a.data, a.solver)
        solver = f' with {a.solver}' if a.solver else ''
        print(f'{a.folder} on {a.data}{solver}: top-1 {r["top1"]:.2f}% ({r["correct"]}/{r["n"]})')
    elif a.cmd == 'demo':
        from .demo import main as demo_main
        return demo_main(model=a.model, root=a.root)
    return 0


def cli(argv: Optional[List[str]] = None) -> int:
    return run_command(main, PROG, argv)


if __name__ == '__main__':
    sys.exit(cli())
