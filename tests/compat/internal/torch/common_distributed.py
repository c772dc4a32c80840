"""``MultiProcessTestCase`` of torch's distributed test suite, which the original's
``tests.internal.torch.common_distributed`` copied: each test method runs in ``world_size``
processes.

The test's ``setUp`` calls ``self._spawn_processes()``; every process then runs the test
method with ``self.rank`` set (``setUp`` does not run there), and the parent's run of the
method waits for them and fails unless each exits with 0. Processes come from a forkserver
(fast to start) and get the parent's environment as it was at ``_spawn_processes``, as spawned
ones would; one still running at the deadline is killed. ``world_size`` is 2 (torch's: 4): the
suite runs on 2 cores. The parent's environment is restored after each test.

Example::

    class MyTest(MultiProcessTestCase):
        def setUp(self):
            super().setUp()
            os.environ["MASTER_PORT"] = str(find_free_port())
            self._spawn_processes()

        def test_world(self):
            bagua.init_process_group()   # in each of the processes
"""

import functools
import os
import unittest

from tests.compat.internal.multi_process import run_processes

MAIN_PROCESS_RANK = -1


class MultiProcessTestCase(unittest.TestCase):
    world_size = 2

    def __init__(self, method_name: str = "runTest") -> None:
        super().__init__(method_name)
        self.rank = MAIN_PROCESS_RANK
        self._exit_codes = None
        test = getattr(self, method_name, None)
        if test is None:  # unittest's and pytest's probe instance ("runTest")
            return

        @functools.wraps(test)
        def join_or_run():
            if self.rank == MAIN_PROCESS_RANK:
                self._join_processes()
            else:
                test()

        setattr(self, method_name, join_or_run)

    def setUp(self) -> None:
        super().setUp()
        saved = dict(os.environ)
        self.addCleanup(lambda: (os.environ.clear(), os.environ.update(saved)))

    def _spawn_processes(self) -> None:
        environ = dict(os.environ)
        args = [(rank, self._testMethodName, environ) for rank in range(self.world_size)]
        self._exit_codes = run_processes(type(self)._run, args)

    @classmethod
    def _run(cls, rank: int, test_name: str, environ: dict) -> None:
        os.environ.clear()
        os.environ.update(environ)
        self = cls(test_name)
        self.rank = rank
        getattr(self, test_name)()

    def _join_processes(self) -> None:
        self.assertIsNotNone(self._exit_codes, "setUp must call self._spawn_processes()")
        for rank, code in enumerate(self._exit_codes):
            self.assertEqual(code, 0, f"process {rank} exited with {code} (None: killed at the deadline)")
