"""The original Bagua's test helpers (``tests.internal``), written anew for the ported tests.

Example::

    from tests.compat.internal.multi_process import MultiProcessTestCase, setup_bagua_env
"""
