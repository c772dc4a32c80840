"""The original ``bagua.torch_api.checkpoint`` (see ``checkpointing``)."""

from .checkpointing import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
