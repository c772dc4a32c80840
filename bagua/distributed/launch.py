"""``python -m bagua.distributed.launch``: the original Bagua's launcher, run by torchrun.

Example::

    python -m bagua.distributed.launch --nproc_per_node=2 main.py --algorithm gradient_allreduce

See ``bagua.distributed._original_flags`` for how the original flags map.
"""

import sys

from ._original_flags import main

if __name__ == "__main__":
    main(sys.argv[1:], "launch")
