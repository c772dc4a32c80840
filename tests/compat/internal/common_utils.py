"""``find_free_port`` of the original's ``tests.internal.common_utils``.

Example::

    port = find_free_port(8000, 8100)
"""

import socket


def find_free_port(port: int = 8000, max_port: int = 9000) -> int:
    """A port that nothing listens on now.

    The original returned the first free port of ``[port, max_port]``; test jobs running at
    the same time then all picked the same port, and ranks of one job joined the other's store.
    The range is accepted and left aside: the operating system picks the port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
