"""Generic fused optimizer: flat buffers for params, grads and optimizer state, and ``fuse_step``.

:func:`fuse_optimizer` moves the parameters, gradients and every per-element state tensor of each
(param group, dtype, device) into contiguous buffers; ``param.data``, ``param.grad`` and the state
tensors become views of them, so model code, LR schedulers, gradient clipping and ``step()`` keep
working unchanged. ``fuse_step()`` then updates whole runs of adjacent parameters at once:

* CUDA, and an optimizer with a single-pass kernel (torch.optim.Adam, AdamW, SGD, bagua Lion):
  one Triton kernel per run (:mod:`bagua.kernels`), every byte read and written once;
* CPU, and SGD / Adam / AdamW / Adagrad: torch's own fused (single-pass) CPU kernel on the flat
  views of the runs (``group["fused"]`` is set for that call only);
* otherwise the optimizer's own ``step()`` on flat views of the runs (one "parameter" per run),
  in cache-sized chunks on CPU, so that a multi-pass step re-reads data still in cache.

``fuse_optimizer(opt, single_pass=False)`` always takes the last way: ``fuse_step()`` then does
the same arithmetic per element as ``step()`` (bit-equal on CPU; the single-pass kernels are
equal only within float rounding).

Scalar state (e.g. Adam's ``step``) stays per parameter, as torch keeps it; ``state_dict()``
returns per-parameter copies, never views of the flat buffers, and ``load_state_dict()`` copies
the loaded values into the flat buffers (the state is views of them again as soon as it returns).

A run is a maximal sequence of parameters of one group that are adjacent in every buffer, have a
gradient, and share their scalar state (e.g. the same ``step``). Anything that breaks that (a
gradient replaced or freed by ``zero_grad(set_to_none=True)``, a state tensor reallocated, a
parameter without a gradient this step, ``add_param_group``) is detected at each ``fuse_step``:
the affected tensors are copied back into their buffer (or updated on their own when that is not
possible), so results stay those of the unfused optimizer; ``check_flatten`` warns once per kind.

Only optimizers whose update is element-wise given per-parameter scalars can be fused. Refused
with an error: torch's LBFGS (one global history), SparseAdam (sparse gradients), Adafactor and
Muon (per-tensor factored state, per-matrix orthogonalization), and any optimizer whose class name
says per-tensor norms or matrix state (LAMB, LARS, NovoGrad, Shampoo, SM3, GaLore, CAME, LOMO).
"""

from __future__ import annotations

import logging
import operator
import re
import types
import warnings
from typing import Any, Callable

import torch
import torch.optim.optimizer as _optimizer_hooks

from bagua.kernels import adam as _adam_k

from .flat_buffers import FlatBucket, FlatRun, is_view
from .kernel_dispatch import KERNELS
from .lion import Lion

logger = logging.getLogger(__name__)

__all__ = ["fuse_optimizer", "fused_update_count", "is_fused_optimizer", "FlattenWarning"]

# Elements per chunk of the optimizer's own step on CPU flat buffers: Adam's operands and
# temporaries for 256K fp32 elements (~6 MiB) stay in the L3 cache between the passes of a
# multi-pass step, and a chunk is long enough that per-op overhead and the split over threads
# stay small. Chosen with benchmarks/optim/fused.py (see benchmarks/results/).
CPU_CHUNK_ELEMS = 1 << 18
# Optimizers with a single-pass fused CPU implementation in torch: on CPU flat buffers fuse_step
# runs that implementation (group["fused"] set for the call) instead of chunks of the multi-pass
# loop: same math within float rounding, each byte read and written once.
_CPU_FUSED_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
# Param dtypes for which torch's fused CPU kernel of an optimizer computes a wrong update: not used
# for a group that holds such a param. torch 2.13's fused CPU SGD (torch._fused_sgd_) moves only
# the elements after the last full SIMD vector of a bfloat16 or float16 tensor and leaves the rest
# unchanged (with or without momentum); float32 and float64 are right.
_CPU_FUSED_WRONG_DTYPES = {torch.optim.SGD: (torch.bfloat16, torch.float16)}
# Optimizers whose CPU flat step is not chunked: few passes per element, so chunks only add
# per-tensor Python work (ASGD reads its scalars with .item() per tensor; bagua Lion's step
# already works in cache-sized chunks). Measured in benchmarks/results/fused_optimizer.md.
_CPU_UNCHUNKED_TYPES = (torch.optim.ASGD, Lion)
# Use the Triton kernels on CPU tensors too (only meaningful under TRITON_INTERPRET=1; for tests).
_KERNELS_ON_CPU = False

_ATTR = "_bagua_fuse"
_PER_TENSOR_NAMES = re.compile(r"lamb|lars|adafactor|novograd|shampoo|muon|sm3|galore|came|lomo", re.I)
_is = operator.is_


class FlattenWarning(UserWarning):
    """Something broke the flat layout of a fused optimizer; ``fuse_step`` repaired or worked around it."""


def is_fused_optimizer(optimizer: Any) -> bool:
    """True if ``optimizer`` went through :func:`fuse_optimizer`.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        >>> is_fused_optimizer(opt), is_fused_optimizer(fuse_optimizer(opt))
        (False, True)
    """
    return isinstance(getattr(optimizer, _ATTR, None), _FuseState)


def fused_update_count(optimizer: torch.optim.Optimizer) -> int:
    """How many times ``fuse_step`` updated two or more parameters of a param group as one flat
    tensor, counted once per param group and step: 0 means nothing was ever fused (no parameters
    adjacent in memory, e.g. ``do_flatten=False`` on separately allocated parameters).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model(torch.randn(1, 2)).sum().backward()
        >>> opt.fuse_step(); fused_update_count(opt)
        1
    """
    fs = getattr(optimizer, _ATTR, None)
    if not isinstance(fs, _FuseState):
        raise ValueError(f"this {type(optimizer).__name__} is not fused; call fuse_optimizer on it first")
    return fs.fused_updates


def gradient_home(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The view of ``optimizer``'s flat gradient buffer that ``param.grad`` should be, when the
    optimizer is fused and flattened ``param``; else None. For wrappers that must give a
    parameter a gradient before the first backward (bagua.DistributedDataParallel) without
    moving it out of the flat buffer.

    Example::

        if p.grad is None:
            p.grad = gradient_home(opt, p)   # zeros, inside the optimizer's flat buffer
    """
    fs = getattr(optimizer, _ATTR, None)
    if fs is None or not fs.do_flatten:
        return None
    for _, _, buckets in fs.groups:
        for b in buckets:
            for i, q in enumerate(b.params):
                if q is param:
                    return b.home_grads[i]
    return None


def _refusal(optimizer: torch.optim.Optimizer) -> str | None:
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS keeps one global state (history of flattened directions) for all parameters"
    if isinstance(optimizer, torch.optim.SparseAdam):
        return "SparseAdam updates sparse gradients, which flat dense buffers cannot hold"
    for cls_name, why in (("Adafactor", "factored row/column second moments per tensor"),
                          ("Muon", "a per-matrix orthogonalization (Newton-Schulz) of each update")):  # fmt: skip
        cls = getattr(torch.optim, cls_name, None)
        if cls is not None and isinstance(optimizer, cls):
            return f"{cls_name} uses {why}"
    if _PER_TENSOR_NAMES.search(name):
        return f"{name} looks like a per-tensor-norm / matrix optimizer (LAMB, LARS, Adafactor, Muon, ...)"
    return None


def fuse_optimizer(
    optimizer: torch.optim.Optimizer, do_flatten: bool = True, check_flatten: bool = True, single_pass: bool = True
) -> torch.optim.Optimizer:
    """Makes ``optimizer`` fused: flat buffers and a ``fuse_step(closure=None)`` method.

    Args:
        optimizer: any ``torch.optim.Optimizer`` whose update is element-wise given per-parameter
            scalars (every torch.optim optimizer except LBFGS, SparseAdam, Adafactor and Muon,
            and user-written optimizers with per-parameter tensor state).
        do_flatten: move params, grads and states into flat buffers per (group, dtype, device).
            With False nothing is moved and ``fuse_step`` fuses only parameters that are already
            adjacent in memory (e.g. flattened by someone else), one by one otherwise.
        check_flatten: warn (once per kind, :class:`FlattenWarning`) when something broke the flat
            layout and ``fuse_step`` had to repair it or update tensors on their own.
        single_pass: run single-pass kernels where one exists (Triton on CUDA; torch's fused CPU
            kernel for SGD, Adam, AdamW, Adagrad): equal to ``step()`` within float rounding. With
            False ``fuse_step`` runs the optimizer's own update on the flat views: the same
            arithmetic per element as ``step()`` (bit-equal on CPU).

    Returns:
        The same optimizer object, with ``fuse_step`` bound on the instance (its class is not
        touched). ``step()`` keeps its behaviour; both may be mixed freely.

    Raises:
        TypeError: not a torch optimizer.
        ValueError: already fused, or an optimizer whose update depends on whole tensors (named in
            the message).

    Example::

        >>> model = torch.nn.Linear(8, 4)
        >>> opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.fuse_step(); opt.zero_grad(set_to_none=False)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fuse_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_fused_optimizer(optimizer):
        raise ValueError(
            f"this {type(optimizer).__name__} is already fused (fuse_optimizer was called on it before); "
            f"call fuse_step() on it directly"
        )
    why = _refusal(optimizer)
    if why is not None:
        raise ValueError(
            f"fuse_optimizer cannot fuse {type(optimizer).__name__}: {why}, so its update changes meaning "
            f"on a flat buffer of many tensors. Use its own step() instead."
        )
    fs = _FuseState(optimizer, bool(do_flatten), bool(check_flatten), bool(single_pass))
    setattr(optimizer, _ATTR, fs)
    optimizer.fuse_step = types.MethodType(_fuse_step, optimizer)
    optimizer.register_step_post_hook(fs.on_step)
    optimizer.register_load_state_dict_post_hook(fs.on_load)
    optimizer.register_state_dict_post_hook(_unview_state_dict)
    with torch.no_grad():
        fs.sync_groups(warn=False)
    return optimizer


def _fuse_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """One optimizer step on the flat buffers (bound on each fused optimizer as ``fuse_step``).

    Same result as ``step(closure)``: the closure, if given, runs first (with grad enabled) and its
    loss is returned.

    Example::

        >>> loss = opt.fuse_step(lambda: model(x).pow(2).sum())  # doctest: +SKIP
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    fs = getattr(self, _ATTR)
    # The step hooks of the optimizer (e.g. bagua.DistributedDataParallel's) run once around the
    # whole fused step, as around step(); the optimizer's own step inside runs without them.
    for pre_hook in (*_optimizer_hooks._global_optimizer_pre_hooks.values(), *self._optimizer_step_pre_hooks.values()):
        pre_hook(self, (), {})
    with torch.no_grad():
        fs.step()
    self._opt_called = True  # what LR schedulers check to see that the optimizer stepped
    fs.in_step = True  # our own post hook must not take this for an unfused step()
    try:
        for post_hook in (*self._optimizer_step_post_hooks.values(), *_optimizer_hooks._global_optimizer_post_hooks.values()):
            post_hook(self, (), {})
    finally:
        fs.in_step = False
    return loss


def _step_without_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's own ``step()`` without the step hooks torch wraps around it."""
    step = type(optimizer).step
    getattr(step, "__wrapped__", step)(optimizer)


def _unview_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """state_dict post hook: per-parameter copies instead of views of the flat buffers (torch.save
    would otherwise store a whole buffer per tensor), in new dicts (the live state is untouched)."""
    state = state_dict["state"]
    for key, per_param in list(state.items()):
        if any(isinstance(v, torch.Tensor) and is_view(v) for v in per_param.values()):
            state[key] = {
                k: (v.clone(memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor) and is_view(v) else v)
                for k, v in per_param.items()
            }
    return state_dict


def _chunk_bounds(numel: int, chunk: int) -> list[tuple[int, int]]:
    """[a, z) pieces of at most ``chunk`` elements (a short tail is merged into the piece before,
    so no piece has a single element and per-element state is never mistaken for a scalar)."""
    bounds = [(a, min(numel, a + chunk)) for a in range(0, numel, chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < max(2, chunk // 4):
        bounds[-2:] = [(bounds[-2][0], numel)]
    return bounds


def _kernels_usable(device: torch.device) -> bool:
    if not _adam_k.HAS_TRITON:
        return False
    return device.type == "cuda" or (_KERNELS_ON_CPU and device.type == "cpu")


# ----------------------------------------------------------------------------------------------
# the per-optimizer fuse state
# ----------------------------------------------------------------------------------------------


class _FuseState:
    def __init__(self, opt: torch.optim.Optimizer, do_flatten: bool, check_flatten: bool, single_pass: bool):
        self.opt = opt
        self.do_flatten = do_flatten
        self.check_flatten = check_flatten
        self.single_pass = single_pass
        self.fused_updates = 0  # see fused_update_count
        self.groups: list[tuple[list, int, list[FlatBucket]]] = []  # (params list, its length, buckets)
        self.warned: set[str] = set()
        self.in_step = False
        self.loading = False
        self.bucketed: set[int] = set()
        self.unbucketed: list[torch.Tensor] = []  # e.g. integer or sparse-layout params

    # hooks
    def on_step(self, opt, args, kwargs) -> None:
        if not self.in_step:  # an unfused step(): scalar state may have changed in place
            self._mark_dirty()

    def on_load(self, opt) -> None:
        """load_state_dict post hook: torch put new state tensors in place of the views; copy them
        into the flat buffers now, so the state is views of them again right after the load."""
        self._mark_dirty()
        self.loading = True  # new state tensors are expected: copy them in without a warning
        try:
            with torch.no_grad():
                self._reanalyze()
        finally:
            self.loading = False

    def _mark_dirty(self) -> None:
        for _, _, buckets in self.groups:
            for b in buckets:
                b.dirty = True

    def warn(self, kind: str, msg: str, stacklevel: int = 7) -> None:
        """Warns once per kind; the default stacklevel points at the caller of fuse_step (from
        _check_param <- analyze <- _reanalyze <- step <- _fuse_step)."""
        if self.check_flatten and kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(f"bagua fuse_step ({type(self.opt).__name__}): {msg}", FlattenWarning, stacklevel=stacklevel)

    def sync_groups(self, warn: bool = True) -> None:
        """Builds buckets for new param groups (and for groups whose params list changed)."""
        pgs = self.opt.param_groups
        changed = len(self.groups) != len(pgs)
        for gi, group in enumerate(pgs):
            params = group["params"]
            if gi < len(self.groups) and self.groups[gi][0] is params and self.groups[gi][1] == len(params):
                continue
            changed = True
            if warn:
                self.warn("groups", "param groups changed after fuse_optimizer (e.g. add_param_group); "
                          "their parameters were flattened now", stacklevel=6)  # fmt: skip
            by_key: dict[tuple, list] = {}
            for p in params:
                if p.is_floating_point() and p.layout == torch.strided:
                    by_key.setdefault((p.dtype, p.device), []).append(p)
            buckets = [FlatBucket(self, ps) for ps in by_key.values()]
            entry = (params, len(params), buckets)
            if gi < len(self.groups):
                self.groups[gi] = entry
            else:
                self.groups.append(entry)
        if changed:
            del self.groups[len(pgs) :]
            self.bucketed = {id(p) for _, _, bs in self.groups for b in bs for p in b.params}
            self.unbucketed = [p for g in pgs for p in g["params"] if id(p) not in self.bucketed]

    def _reanalyze(self) -> None:
        """Rebuilds the runs of every bucket in which something moved (repairing the layout)."""
        self.sync_groups()
        state = self.opt.state
        for _, _, buckets in self.groups:
            for b in buckets:
                if not b.unchanged(state):
                    b.analyze(state)

    def step(self) -> None:
        opt = self.opt
        self._reanalyze()
        own_runs: list[tuple[int, FlatRun]] = []
        kernel_fn = KERNELS.get(type(opt)) if self.single_pass else None
        for gi, (_, _, buckets) in enumerate(self.groups):
            group = opt.param_groups[gi]
            if any(run.i1 - run.i0 > 1 for b in buckets for run in b.runs):
                self.fused_updates += 1
            for b in buckets:
                use_kernel = kernel_fn is not None and _kernels_usable(b.device)
                for run in b.runs:
                    if not (use_kernel and kernel_fn(opt, group, run)):
                        own_runs.append((gi, run))
        if own_runs or any(p.grad is not None for _, _, bs in self.groups for b in bs for p in b.singles) \
                or self._unbucketed_with_grad():  # fmt: skip
            self._own_step(own_runs)

    def _cpu_fused_ok(self, group: dict) -> bool:
        """Whether this group's CPU flat step can run torch's own fused (single-pass) CPU kernel."""
        wrong = _CPU_FUSED_WRONG_DTYPES.get(type(self.opt), ())
        return (
            self.single_pass
            and type(self.opt) in _CPU_FUSED_TYPES
            and "fused" in group
            and not group.get("differentiable", False)
            and all(p.device.type == "cpu" and p.dtype not in wrong for p in group["params"])
        )

    def _unbucketed_with_grad(self) -> bool:
        return any(p.grad is not None for p in self.unbucketed)

    def _own_step(self, own_runs: list[tuple[int, FlatRun]]) -> None:
        """The optimizer's own step() with each run replaced by flat views (chunked on CPU)."""
        opt, state = self.opt, self.opt.state
        cpu_fused = [self._cpu_fused_ok(group) for group in opt.param_groups]
        new_params: list[list[torch.Tensor]] = [[] for _ in opt.param_groups]
        temps: list[tuple[FlatRun, list[tuple[int, int, torch.Tensor, dict]]]] = []
        for gi, run in own_runs:
            st0 = state.get(run.params[0], {})
            chunked = run.bucket.device.type == "cpu" and not cpu_fused[gi] and type(opt) not in _CPU_UNCHUNKED_TYPES
            chunk = CPU_CHUNK_ELEMS if chunked else run.numel
            pieces = []
            for a, z in _chunk_bounds(run.numel, chunk):
                fp = run.param_view[a:z]
                fp.grad = run.grad_view[a:z]
                st = {k: v[a:z] for k, v in run.state_views.items()}
                for k in run.tensor_keys:
                    st[k] = st0[k].clone()
                for k in run.py_keys:
                    st[k] = st0[k]
                state[fp] = st
                pieces.append((a, z, fp, st))
                new_params[gi].append(fp)
            temps.append((run, pieces))
        for gi, (_, _, buckets) in enumerate(self.groups):
            for b in buckets:
                new_params[gi].extend(b.singles)
        for gi, group in enumerate(opt.param_groups):
            new_params[gi].extend(p for p in group["params"] if id(p) not in self.bucketed)
        saved = [(group["params"], group.get("fused"), group.get("foreach")) for group in opt.param_groups]
        toggled = [False] * len(saved)
        self.in_step = True
        try:
            for gi, (group, ps) in enumerate(zip(opt.param_groups, new_params)):
                group["params"] = ps
                if cpu_fused[gi] and all(p.device.type == "cpu" for p in ps):
                    group["fused"], group["foreach"] = True, False
                    toggled[gi] = True
            _step_without_hooks(opt)
        finally:
            for gi, (group, (ps, fused, foreach)) in enumerate(zip(opt.param_groups, saved)):
                group["params"] = ps
                if toggled[gi]:
                    group["fused"], group["foreach"] = fused, foreach
            self.in_step = False
            for _, pieces in temps:
                for _, _, fp, _ in pieces:
                    state.pop(fp, None)
        for run, pieces in temps:
            self._write_back(run, pieces, state)

    def _write_back(self, run: FlatRun, pieces: list, state: dict) -> None:
        """Copies what the optimizer's step changed on the flat views back to each parameter."""
        b = run.bucket
        st_first = pieces[0][3]
        for k, v in st_first.items():
            if k in run.state_views:
                for a, z, _, st in pieces:
                    if st[k] is not None and st[k].data_ptr() != run.state_views[k][a:z].data_ptr():
                        run.state_views[k][a:z].copy_(st[k].reshape(-1))  # the step reallocated it
            elif isinstance(v, torch.Tensor) and all(
                isinstance(st.get(k), torch.Tensor) and st[k].shape == (z - a,) for a, z, _, st in pieces
            ):  # new per-element state (pieces have >= 2 elements, so never a scalar)
                b.adopt(run, k, [(a, z, st[k]) for a, z, _, st in pieces], state)
            elif isinstance(v, torch.Tensor) and v.numel() == 1:
                if k in run.scalar_views:
                    run.scalar_views[k].copy_(v)
                elif k in run.scalar_lists:
                    torch._foreach_copy_(run.scalar_lists[k], [v] * len(run.params))
                else:
                    for p in run.params:
                        state[p][k] = v.clone()
                    b.dirty = True
                if k == "step":
                    run.step_value = None
            elif isinstance(v, torch.Tensor):
                raise RuntimeError(
                    f"fuse_step: {type(self.opt).__name__} created state {k!r} of shape {tuple(v.shape)} for a "
                    f"flat run of {run.numel} elements; only per-element and scalar state can be fused. "
                    f"Use step() for this optimizer."
                )
            elif v is None:
                if any(k not in state[p] for p in run.params):
                    for p in run.params:
                        state[p][k] = None
                    b.dirty = True
            else:
                for p in run.params:
                    state[p][k] = v
                if k in run.py_keys:
                    b.refresh_key(k, state)
                else:
                    b.dirty = True
