"""A ``file://`` rendezvous of its own for each torch.distributed job of the ported tests.

The original tests' reference runs all met at ``file:///tmp/.bagua.test.filestore``; a file
left over by a killed run, or the same file used by another test job on the machine at the
same time, would join the wrong job. Each call names a fresh file in a temporary directory of
this process, removed when it exits (the ranks exit without destroying their group, so torch's
FileStore leaves the file behind).

Example::

    torch.distributed.init_process_group("gloo", init_method=file_init_method(), rank=r, world_size=2)
"""

import atexit
import itertools
import os
import shutil
import tempfile

_count = itertools.count()
_directory = None


def file_init_method() -> str:
    """A new ``file://`` URL, unique to this process and call."""
    global _directory
    if _directory is None:
        _directory = tempfile.mkdtemp(prefix="bagua-compat-filestore-")
        atexit.register(shutil.rmtree, _directory, ignore_errors=True)
    return "file://" + os.path.join(_directory, f"store{next(_count)}")
