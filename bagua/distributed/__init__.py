"""The original Bagua's launchers: ``python -m bagua.distributed.launch`` and
``python -m bagua.distributed.run``, both run by torchrun (see ``_original_flags``)."""
