"""What the wrapper offers algorithm writers: ``ddp.for_algorithms``, apart from the user's API.

An ``AlgorithmImpl``'s hooks get the wrapper (``ddp``) and reach its buckets through
``ddp.for_algorithms``: which tensor becomes a gradient's bucket view, which parameters a bucket
holds, and when buckets are handed to the engine (``docs/writing_an_algorithm.md``). The
wrapper's own surface stays the one a torch DDP user knows.

Example::

    class MyImpl(AlgorithmImpl):
        def on_optimizer_step_post(self, ddp):
            with torch.no_grad():
                ddp.for_algorithms.communicate_all()   # every bucket's ops, in bucket order, finished
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..comm import Bucket

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


class ForAlgorithms:
    """The wrapper's buckets and engine, as algorithms use them (one per wrapper)."""

    def __init__(self, ddp: "DistributedDataParallel"):
        self._ddp = ddp

    def gradient_slot(self, name: str) -> torch.Tensor:
        """The tensor that becomes parameter ``name``'s gradient view in a bucket: its current
        gradient if it has one, else its slot in a fused optimizer's flat gradient buffer, else
        zeros. The parameter's ``.grad`` is left as it is (None stays None until backward).

        Example::

            def tensors_to_communicate(self, ddp):
                return [(n, ddp.for_algorithms.gradient_slot(n)) for n, _ in ddp.named_trainable_parameters]
        """
        ddp = self._ddp
        p = ddp._params[name]
        slot = p.grad if p.grad is not None else ddp._gradient_home(p)
        if slot is None:
            slot = torch.zeros_like(p, memory_format=torch.contiguous_format)
        ddp._gradient_slots[name] = slot
        return slot

    def names_in(self, bucket: Bucket) -> list[str]:
        """The names (parameter names) of ``bucket``'s tensors, in bucket order.

        Example::

            params = [ddp.for_algorithms.parameter(n) for n in ddp.for_algorithms.names_in(bucket)]
        """
        ddp = self._ddp
        return ddp._bucket_names[next(i for i, b in enumerate(ddp.buckets) if b is bucket)]

    def parameter(self, name: str) -> torch.nn.Parameter:
        """The trainable parameter called ``name``.

        Example::

            ddp.for_algorithms.parameter("0.weight").grad
        """
        return self._ddp._params[name]

    @property
    def per_parameter_reason(self) -> Optional[str]:
        """Why this wrapper readies its buckets one parameter at a time (calling ``on_tensor_ready``
        for each), or None: per bucket, each bucket ready once its last gradient is accumulated
        (``bagua.parallel.backward``).

        Example::

            ddp.for_algorithms.per_parameter_reason   # "QAdamImpl acts on each tensor as it becomes ready ..."
        """
        return self._ddp._backward.reason

    def produced_gradient(self) -> Optional[torch.Tensor]:
        """Inside ``on_tensor_ready``: the gradient tensor backward has just produced for that
        parameter, which the wrapper then copied into the parameter's bucket view (its ``.grad``
        now): a copy of the gradient's bits as backward left them, which nothing else holds. None
        when backward accumulated into the view itself (a gradient not set to None since the
        last step) or the parameter has no view.

        Example::

            def on_tensor_ready(self, ddp, name, param):
                snapshot = ddp.for_algorithms.produced_gradient()
                if snapshot is None:
                    snapshot = param.grad.clone()
        """
        return self._ddp._produced_gradient

    def mark_ready(self, name: str) -> None:
        """Declare the bucketed tensor ``name`` ready for this step: a bucket whose tensors are all
        ready launches its ops, in bucket order.

        Example::

            def on_tensor_ready(self, ddp, name, param):
                ddp.for_algorithms.mark_ready(name)
        """
        ddp = self._ddp
        ddp.engine.mark_ready_at(*ddp._slot[name])

    def mark_all_ready(self) -> None:
        """Declare every bucketed tensor ready now: all buckets launch, in order (the end of
        backward waits for them).

        Example::

            def on_forward_pre(self, ddp):
                ddp.for_algorithms.mark_all_ready()     # exchange weights while forward runs
        """
        self._ddp.engine.mark_all_ready()

    def mark_bucket_ready(self, bucket_index: int) -> None:
        """Declare every tensor of bucket ``bucket_index`` (of ``ddp.buckets``) ready for this step
        at once, none of them marked yet: what the wrapper does when backward has accumulated a
        bucket's last gradient.

        Example::

            ddp.for_algorithms.mark_bucket_ready(0)
        """
        self._ddp.engine.mark_bucket_ready(bucket_index)

    def reset_operations(self) -> None:
        """Append every bucket's ops anew (``impl.init_operations``), between steps: for an
        algorithm whose ops depend on its phase (qadam: gradients in warm-up, momentum after it).

        Example::

            def on_optimizer_step_post(self, ddp):
                if self.phase_changed():
                    ddp.for_algorithms.reset_operations()
        """
        ddp = self._ddp
        for bucket in ddp.buckets:
            bucket.clear_ops()
            ddp.impl.init_operations(ddp, bucket)

    def communicate_all(self) -> None:
        """Run every bucket's ops now, in bucket order, and wait for them (for algorithms that
        communicate outside backward, e.g. after the optimizer step).

        Example::

            with torch.no_grad():
                ddp.for_algorithms.communicate_all()
        """
        self.mark_all_ready()
        self._ddp.engine.wait()
