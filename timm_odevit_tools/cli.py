"""How every command of the tools ends: exit 0 when it did its job, 2 with one line naming the option or file and the
fix when the user's input cannot work, never a traceback for that (``--debug`` or ``TIMM_ODEVIT_DEBUG=1`` shows
it), and the command's own non-zero status when the job ran and failed (a diverged training run, a failed check).

Errors a user causes surface as these exception types (ours are subclasses of them); anything else is a bug and
keeps its traceback."""
import os
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type

__all__ = ['CommandFailed', 'DEBUG_ENV', 'USER_ERRORS', 'run_command']

DEBUG_ENV = 'TIMM_ODEVIT_DEBUG'


class CommandFailed(Exception):
    """The job ran and did not succeed (a diverged run, say): its message and the status the command exits with."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


USER_ERRORS: Tuple[Type[BaseException], ...] = (ValueError, TypeError, OSError, KeyError)


def run_command(main: Callable[[Optional[List[str]]], Any], prog: str, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``main(argv)`` as a command: its exit status (an int ``main`` returns; 0 for anything else it returns),
    or 2 after printing ``<prog>: error: <message>`` for a user error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = '--debug' in argv or os.environ.get(DEBUG_ENV, '') not in ('', '0')
    argv = [a for a in argv if a != '--debug']
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own refusals (usage and one error line, status 2), --help (0)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except KeyboardInterrupt:
        print(f'{prog}: interrupted', file=sys.stderr)
        return 130
    except CommandFailed as e:
        if debug:
            raise
        print(f'{prog}: failed: {e}', file=sys.stderr)
        return e.status
    except USER_ERRORS as e:
        if debug:
            raise
        message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f'{prog}: error: {message or type(e).__name__}\n(the full traceback: add --debug, or set '
              f'{DEBUG_ENV}=1)', file=sys.stderr)
        return 2
    return status if isinstance(status, int) and not isinstance(status, bool) else 0
