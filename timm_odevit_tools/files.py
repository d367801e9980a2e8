"""What a failed write tells the user: the tools write checkpoints, exported weights and the data cache to a temporary
file or folder and rename it into place, so a failure (a full disk, most often) leaves every earlier file as it was;
this names the folder, the free space there, what is still good, and what to do."""
import errno
import shutil
from pathlib import Path
from typing import Union

__all__ = ['WriteFailed', 'write_failed']


class WriteFailed(OSError):
    """A write that failed and changed nothing that was there before (see ``write_failed``)."""


def write_failed(what: str, folder: Union[str, Path], error: BaseException, kept: str) -> WriteFailed:
    """``WriteFailed`` for ``what`` in ``folder``: the cause (a full disk named as such), the space left there, and
    ``kept``, the sentence that says what is still good and how to go on."""
    try:
        free = f'; {shutil.disk_usage(folder).free / 2 ** 20:.0f} MiB free there'
    except OSError:
        free = ''
    full = getattr(error, 'errno', None) == errno.ENOSPC or 'unexpected pos' in str(error)  # torch's zip writer
    cause = 'the disk is full' if full else f'{type(error).__name__}: {error}'
    return WriteFailed(errno.ENOSPC if full else getattr(error, 'errno', None) or errno.EIO,
                       f'{what} in {folder} failed ({cause}{free}). {kept}')
