"""``python -m bagua.distributed.run``: the original Bagua's elastic launcher, run by torchrun.

Example::

    python -m bagua.distributed.run --nnodes=1:2 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=host:29400 main.py

See ``bagua.distributed._original_flags`` for how the original flags map.
"""

import sys

from ._original_flags import main

if __name__ == "__main__":
    main(sys.argv[1:], "run")
