"""The original Bagua launchers' command lines, run by torchrun.

``python -m bagua.distributed.launch`` and ``python -m bagua.distributed.run`` accept the
original flags: torchrun's own (which torchrun spells with underscores too), plus Bagua's:

- ``--default_bucket_size N``: sets ``BAGUA_DEFAULT_BUCKET_SIZE`` for the workers (the bucket
  size of ``model.with_bagua``);
- ``--enable_bagua_net``: the workers stripe large collectives over several connections
  (``BAGUA_NET_NSTREAMS``, Bagua-Net's default 2 unless set; ``bagua.comm``'s stripes replace
  the NCCL plugin);
- ``--bagua_service_port``: accepted, no effect (there is no autotune service to reach);
- ``--autotune_level 1`` (or 2): sets ``BAGUA_AUTOTUNE=1``: every wrapper tunes itself in
  process during its first steps; ``--is_output_autotune_log`` writes the trials to
  ``/tmp/bagua_autotune.csv`` (``BAGUA_AUTOTUNE_LOG``); the service's sampling flags
  (``--autotune_max_samples``, ``--autotune_warmup_time``, ``--autotune_sampling_confidence_time``)
  are accepted and not used, with a warning (the budget is ``bagua.AutotuneConfig``'s);
- ``--report_metrics``, ``--host_list``/``--ssh_port`` (starting hosts over ssh): a clear error
  saying what to do;
- launch's ``--logdir`` is torchrun's ``--log-dir``, and ``--set_additional_flag`` passes
  ``--local-rank=N`` to the script (torch's spelling: a script parsing only ``--local_rank``
  should read ``LOCAL_RANK`` instead); without it the rank is in ``LOCAL_RANK`` only.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Optional, Sequence

_NOT_SUPPORTED = {
    "report_metrics": "metrics reporting to the autotune service is not part of this bagua; run without --report_metrics",
    "host_list": "starting hosts over ssh is not part of this bagua; run the launcher on each host "
                 "(--nnodes, --node_rank, --master_addr) or use torchrun's rendezvous",
    "ssh_port": "starting hosts over ssh is not part of this bagua; run the launcher on each host",
}
_AUTOTUNE_SAMPLING = {"autotune_max_samples": 60, "autotune_sampling_confidence_time": 5.0, "autotune_warmup_time": 30.0}
AUTOTUNE_LOG_PATH = "/tmp/bagua_autotune.csv"


def main(argv: Optional[Sequence[str]], launcher: str) -> None:
    """Parse the original ``launcher``'s (``"launch"`` or ``"run"``) command line and run torchrun."""
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = f"python -m bagua.distributed.{launcher}"
    parser.add_argument("--bagua_service_port", type=int, default=29501, help="accepted, no effect")
    parser.add_argument("--default_bucket_size", type=int, default=10 * 1024**2,
                        help="bucket size in bytes of model.with_bagua (BAGUA_DEFAULT_BUCKET_SIZE)")
    parser.add_argument("--autotune_level", type=int, default=0, choices=(0, 1, 2),
                        help="1 or 2: the workers tune themselves (BAGUA_AUTOTUNE=1)")
    parser.add_argument("--autotune_max_samples", type=int, default=60, help=argparse.SUPPRESS)
    parser.add_argument("--autotune_sampling_confidence_time", type=float, default=5.0, help=argparse.SUPPRESS)
    parser.add_argument("--autotune_warmup_time", type=float, default=30.0, help=argparse.SUPPRESS)
    parser.add_argument("--is_output_autotune_log", action="store_true",
                        help=f"write the autotuning trials to {AUTOTUNE_LOG_PATH} (BAGUA_AUTOTUNE_LOG)")
    parser.add_argument("--enable_bagua_net", action="store_true",
                        help="stripe collectives over several connections (BAGUA_NET_NSTREAMS, default 2)")
    parser.add_argument("--report_metrics", action="store_true", help="not supported")
    parser.add_argument("--host_list", type=str, default=None, help="not supported")
    parser.add_argument("--ssh_port", type=int, default=None, help="not supported")
    if launcher == "launch":
        parser.add_argument("--logdir", type=str, default=None, help="torchrun's --log-dir")
        parser.add_argument("--set_additional_flag", action="store_true", help="pass --local-rank=N to the script")
    else:
        parser.add_argument("--use_env", action="store_true", help="accepted (the rank is always in LOCAL_RANK)")
    args = parser.parse_args(argv)

    for name, why in _NOT_SUPPORTED.items():
        if getattr(args, name) not in (None, False):
            parser.error(f"--{name}: {why}")
    changed = [f"--{name}" for name, default in _AUTOTUNE_SAMPLING.items() if getattr(args, name) != default]
    if changed:
        warnings.warn(f"{', '.join(changed)}: not used; autotuning runs in process, its budget set by "
                      f"bagua.AutotuneConfig (about 50 steps by default)", stacklevel=2)
    if args.autotune_level:
        os.environ.setdefault("BAGUA_AUTOTUNE", "1")
        if args.is_output_autotune_log:
            os.environ.setdefault("BAGUA_AUTOTUNE_LOG", AUTOTUNE_LOG_PATH)
    elif args.is_output_autotune_log:
        parser.error("--is_output_autotune_log: there is nothing to log without --autotune_level 1")
    if args.default_bucket_size < 1:
        parser.error(f"--default_bucket_size must be a positive number of bytes, got {args.default_bucket_size}")
    os.environ["BAGUA_DEFAULT_BUCKET_SIZE"] = str(args.default_bucket_size)
    if args.enable_bagua_net:  # Bagua-Net's streams per connection (its default 2) for bagua.comm's stripes
        os.environ.setdefault("BAGUA_NET_NSTREAMS", "2")
    if launcher == "launch":
        args.log_dir = args.log_dir or args.logdir
        args.use_env = not args.set_additional_flag
    else:
        args.use_env = True
    for name in ("bagua_service_port", "default_bucket_size", "enable_bagua_net", "logdir", "set_additional_flag", *_NOT_SUPPORTED,
                 "autotune_level", "is_output_autotune_log", *_AUTOTUNE_SAMPLING):
        if hasattr(args, name):
            delattr(args, name)
    run(args)
