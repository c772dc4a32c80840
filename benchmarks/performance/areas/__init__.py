"""The figures of the performance page, one module per area of the page (``registry.AREAS``); each
module's ``FIGURES`` lists its area's figures in the order the page shows them.

Example::

    from benchmarks.performance.areas import data
    [f.name for f in data.FIGURES][:1]      # ['cache_lmdb_epoch2']
"""
