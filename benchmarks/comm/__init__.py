"""Communication: ``bagua.comm``'s collectives against torch's, on loopback and emulated links.

- ``allreduce`` (and ``allreduce_report``): allreduce bus bandwidth, raw torch against bagua,
  checked, unchecked and compressed (``make bench-comm``)
- ``stripes``: striped collectives (``streams=K``) under per-connection caps
- ``p2p_pieces``: Gloo point-to-point time against message piece size (run as the ranks of the
  emulated network)
- ``compressed_breakdown``: where a compressed gradient allreduce's step goes, per thread

Example (from the repository root)::

    python -m benchmarks.comm.allreduce --rates --ranks 2
"""
