"""Lightning's spelling of Bagua's strategy: ``from lightning_bagua import BaguaStrategy``.

The module the Lightning documentation names for Bagua; it is ``bagua.lightning.BaguaStrategy``
(shipped in the same distribution, ``pip install 'bagua-torch[lightning]'``), and importing it
registers ``Trainer(strategy="bagua")`` too.

Example::

    import lightning.pytorch as pl
    from lightning_bagua import BaguaStrategy

    trainer = pl.Trainer(strategy=BaguaStrategy(algorithm="bytegrad"), accelerator="cpu", devices=2)
"""

from bagua.lightning import BaguaStrategy

__all__ = ["BaguaStrategy"]
