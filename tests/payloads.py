"""A pickled object that runs code when unpickled: what a hostile checkpoint or cache value holds.

Example::

    data = pickle.dumps(RunsCodeWhenUnpickled(tmp_path / "marker"))
    pickle.loads(data)          # writes the marker file: the loader ran the writer's code
"""

from __future__ import annotations

from pathlib import Path


def write_marker(path: str) -> str:
    Path(path).write_text("unpickling ran code")
    return path


class RunsCodeWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return write_marker, (self.marker,)
