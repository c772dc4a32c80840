import os

import torch

# Run Triton kernels on CPU through Triton's interpreter when there is no GPU; this must happen
# before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The slowest modules (whole torchrun jobs, restarts, Lightning), slowest first: collected ahead of
# the rest so that under `pytest -n 2` (xdist hands out tests in collection order, alternating
# workers) both workers start on them and finish with the short tests together, instead of one
# worker picking up a 2-minute job last while the other idles. Order only; nothing is skipped.
SLOW_FIRST = (
    "tests/elastic/test_elastic_digits.py",
    "tests/compat/examples/test_original_examples.py",
    "tests/examples/test_lightning_digits.py",
    "tests/elastic/test_c10d_scale.py",
    "tests/examples/test_train_digits.py",
    "tests/lightning/test_strategy.py",
    "tests/data/test_cached_dataset.py",
    "tests/parallel/test_convergence.py",
    "tests/comm/test_exit.py",
    "tests/examples/test_train_lm.py",
    "tests/benchmarks/test_tradeoff.py",
    "tests/elastic/test_restart.py",
    "tests/advise/test_cli.py",
    "tests/benchmarks/test_gpu_check.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    root = config.rootpath

    def key(item):
        try:
            path = item.path.relative_to(root).as_posix()
        except ValueError:
            path = str(item.path)
        return rank.get(path, len(SLOW_FIRST))

    items.sort(key=key)  # stable: within a module, and for every other module, the order is unchanged
