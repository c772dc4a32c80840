"""The flat layout behind ``fuse_optimizer``: one ``FlatBucket`` per (param group, dtype,
device) holding its params, gradients and optimizer states as views of contiguous buffers, and
``FlatRun``s, the stretches of params adjacent in every buffer that one flat update covers.

Example::

    bucket = FlatBucket(fuse_state, params)     # fuse_state: the optimizer's _FuseState
    for run in bucket.runs:
        run.param_view, run.grad_view, run.state_views   # flat views over the run's params
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .fused import _FuseState

__all__ = ["FlatBucket", "FlatRun", "is_view"]

logger = logging.getLogger(__name__)
_is = operator.is_


def is_view(t: torch.Tensor) -> bool:
    return t._base is not None or t.untyped_storage().nbytes() > t.numel() * t.element_size()


def _flat_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D view of ``numel`` elements of t's storage, starting at t's first element."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (numel,))


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() + a.numel() == b.storage_offset()
    )


def _dense_contiguous(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.is_contiguous()


# ----------------------------------------------------------------------------------------------
# runs and buckets
# ----------------------------------------------------------------------------------------------


class FlatRun:
    """Params [i0, i1) of a bucket, adjacent in every buffer, updated as one flat tensor."""

    __slots__ = ("bucket", "i0", "i1", "numel", "flat_keys", "tensor_keys", "py_keys", "params",
                 "param_view", "grad_view", "state_views", "scalar_lists", "scalar_views", "step_value")  # fmt: skip

    def __init__(self, bucket: "FlatBucket", i0: int, i1: int, sig: tuple, state: dict):
        self.bucket, self.i0, self.i1 = bucket, i0, i1
        self.params = bucket.params[i0:i1]
        self.numel = sum(bucket.numels[i0:i1])
        self.flat_keys = tuple(k for k, kind, *_ in sig if kind == "flat")
        self.tensor_keys = tuple(k for k, kind, *_ in sig if kind == "tensor")
        self.py_keys = tuple(k for k, kind, *_ in sig if kind == "py")
        p0 = self.params[0]
        self.param_view = _flat_view(p0, self.numel)
        self.grad_view = _flat_view(p0.grad, self.numel)
        st0 = state[p0] if self.flat_keys or self.tensor_keys or self.py_keys else {}
        self.state_views = {k: _flat_view(st0[k], self.numel) for k in self.flat_keys}
        self.scalar_lists = {k: [state[p][k] for p in self.params] for k in self.tensor_keys}
        # scalar state held in the bucket's scalar buffers: one op updates the whole run
        self.scalar_views = {}
        for k in self.tensor_keys:
            homes = bucket.scalar_homes.get(k)
            if homes is not None and all(map(_is, self.scalar_lists[k], homes[i0:i1])):
                self.scalar_views[k] = bucket.scalar_bufs[k][i0:i1]
        step = st0.get("step")
        self.step_value = float(step.item()) if isinstance(step, torch.Tensor) else None


class FlatBucket:
    """The params of one (group, dtype, device), in group order, and their flat buffers."""

    def __init__(self, fs: "_FuseState", params: list[torch.Tensor]):
        self.fs = fs
        self.params = params
        self.numels = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.offsets, total = [], 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.total = total
        p0 = params[0]
        self.dtype, self.device = p0.dtype, p0.device
        self.state_bufs: dict[str, torch.Tensor] = {}
        self.state_homes: dict[str, list[torch.Tensor]] = {}
        # 0-dim tensor state (e.g. "step") as views of one 1-D buffer per key
        self.scalar_bufs: dict[str, torch.Tensor] = {}
        self.scalar_homes: dict[str, list[torch.Tensor]] = {}
        self.grad_was_home = [False] * len(params)
        self.state_was_home: set[tuple[str, int]] = set()
        self.flat_param = self.flat_grad = None
        self.home_params: list[torch.Tensor] = []
        self.home_grads: list[torch.Tensor] = []
        if fs.do_flatten:
            self._flatten()
        self.dirty = True
        self.runs: list[FlatRun] = []
        self.singles: list[torch.Tensor] = []
        self._cache: tuple | None = None

    # -- flattening ----------------------------------------------------------------------------
    def _slice(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        o = self.offsets[i]
        return buf[o : o + self.numels[i]].view(self.shapes[i])

    def _flatten(self) -> None:
        self.flat_param = torch.empty(self.total, dtype=self.dtype, device=self.device)
        self.flat_grad = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        self.home_params = [self._slice(self.flat_param, i) for i in range(len(self.params))]
        self.home_grads = [self._slice(self.flat_grad, i) for i in range(len(self.params))]
        state = self.fs.opt.state
        for i, p in enumerate(self.params):
            self.home_params[i].copy_(p.detach())
            p.data = self.home_params[i]
            g = p.grad
            if g is not None and g.layout == torch.strided and g.shape == p.shape and g.dtype == p.dtype:
                self.home_grads[i].copy_(g)
                p.grad = self.home_grads[i]
                self.grad_was_home[i] = True
            st = state.get(p)
            if st:
                for k, v in list(st.items()):
                    if self._is_flat_state(p, v):
                        home = self._state_home(k, i, v.dtype)
                        if home is not None:
                            home.copy_(v)
                            st[k] = home
                            self.state_was_home.add((k, i))
                    elif isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad:
                        self._scalar_to_home(st, k, i, v)

    def _is_flat_state(self, p: torch.Tensor, v: Any) -> bool:
        # A one-element parameter's state of its own shape, e.g. (1,), is per element too; only a
        # 0-dim parameter's state could be a scalar (as "step" is), so that stays out.
        return (
            isinstance(v, torch.Tensor)
            and (p.numel() > 1 or (p.numel() == 1 and p.dim() > 0))
            and v.shape == p.shape
            and v.device == p.device
            and v.layout == torch.strided
        )

    def _state_home(self, key: str, i: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The slot of param i in the flat buffer of state ``key`` (created on first use), or None
        when that buffer has another dtype."""
        buf = self.state_bufs.get(key)
        if buf is None:
            buf = torch.zeros(self.total, dtype=dtype, device=self.device)
            self.state_bufs[key] = buf
            self.state_homes[key] = [self._slice(buf, j) for j in range(len(self.params))]
        elif buf.dtype != dtype:
            return None
        return self.state_homes[key][i]

    def _scalar_to_home(self, st: dict, key: str, i: int, v: torch.Tensor) -> None:
        """Moves 0-dim tensor state (e.g. Adam's step) into the bucket's scalar buffer for ``key``
        (created on first use) unless that buffer has another dtype or device."""
        buf = self.scalar_bufs.get(key)
        if buf is None:
            buf = torch.zeros(len(self.params), dtype=v.dtype, device=v.device)
            self.scalar_bufs[key] = buf
            self.scalar_homes[key] = [buf[j] for j in range(len(self.params))]
        elif buf.dtype != v.dtype or buf.device != v.device:
            return
        home = self.scalar_homes[key][i]
        if v is not home:
            home.copy_(v)
            st[key] = home

    # -- per-step checks -------------------------------------------------------------------------
    def _snapshot(self, state: dict) -> tuple:
        ps = self.params
        sts = [state.get(p) for p in ps]
        keys = sorted({k for s in sts if s for k in s})
        return (
            [p.data_ptr() for p in ps],
            [p.grad for p in ps],
            sts,
            [len(s) if s is not None else -1 for s in sts],
            {k: [s.get(k) if s is not None else None for s in sts] for k in keys},
        )

    def unchanged(self, state: dict) -> bool:
        """Cheap check that nothing moved since the runs were built (identity of grads, state
        dicts and state values; data pointers of params)."""
        c = self._cache
        if self.dirty or c is None:
            return False
        ps = self.params
        if [p.data_ptr() for p in ps] != c[0]:
            return False
        if not all(map(_is, [p.grad for p in ps], c[1])):
            return False
        sts = [state.get(p) for p in ps]
        if not all(map(_is, sts, c[2])):
            return False
        if [len(s) if s is not None else -1 for s in sts] != c[3]:
            return False
        for k, vals in c[4].items():
            if not all(map(_is, [s.get(k) if s is not None else None for s in sts], vals)):
                return False
        return True

    def refresh_key(self, key: str, state: dict) -> None:
        """Updates the snapshot of one state key after fuse_step assigned new values to it."""
        if self._cache is not None and key in self._cache[4]:
            self._cache[4][key] = [s.get(key) if s is not None else None for s in self._cache[2]]

    # -- analysis ------------------------------------------------------------------------------
    def analyze(self, state: dict) -> None:
        """Repairs what moved (with do_flatten), then splits the params into runs and singles."""
        eligible: list[tuple | None] = []
        for i, p in enumerate(self.params):
            eligible.append(self._check_param(i, p, state))
        self.runs, self.singles = [], []
        i, n = 0, len(self.params)
        while i < n:
            sig = eligible[i]
            if sig is None:
                self.singles.append(self.params[i])
                i += 1
                continue
            j = i + 1
            while j < n and eligible[j] == sig and self._adjacent_params(j - 1, j, sig, state):
                j += 1
            if sum(self.numels[i:j]) > 1:
                self.runs.append(FlatRun(self, i, j, sig, state))
            else:
                self.singles.extend(self.params[i:j])
            i = j
        self._cache = self._snapshot(state)
        self.dirty = False
        logger.debug("bucket %s/%s: %d runs, %d single params", self.dtype, self.device, len(self.runs),
                     len(self.singles))  # fmt: skip

    def _adjacent_params(self, a: int, b: int, sig: tuple, state: dict) -> bool:
        pa, pb = self.params[a], self.params[b]
        if not (_adjacent(pa, pb) and _adjacent(pa.grad, pb.grad)):
            return False
        sa, sb = state.get(pa), state.get(pb)
        return all(_adjacent(sa[k], sb[k]) for k, kind, *_ in sig if kind == "flat")

    def _check_param(self, i: int, p: torch.Tensor, state: dict) -> tuple | None:
        """Repairs param i where possible; returns its state signature if it can join a run."""
        fs = self.fs
        flatten = fs.do_flatten
        if not p.is_floating_point() or p.shape != self.shapes[i] or p.dtype != self.dtype or p.device != self.device:
            return None
        if flatten and p.data_ptr() != self.home_params[i].data_ptr():
            fs.warn("param", "a parameter's .data was replaced after fuse_optimizer; it was copied back "
                    "into the flat buffer")  # fmt: skip
            self.home_params[i].copy_(p.detach())
            p.data = self.home_params[i]
        sig = self._state_signature(i, p, state)  # also for a param without a gradient this step
        g = p.grad
        if g is None:
            return None  # the optimizer's own step decides (torch skips it)
        if g.layout != torch.strided:
            raise ValueError(
                f"fuse_step: a parameter of shape {tuple(p.shape)} has a {g.layout} (sparse) gradient; flat "
                f"buffers hold dense gradients only. Use step() for this optimizer, or dense gradients "
                f"(e.g. nn.Embedding(sparse=False))."
            )
        if g.shape != p.shape or g.dtype != p.dtype:
            return None
        if flatten and g.data_ptr() != self.home_grads[i].data_ptr():
            if self.grad_was_home[i]:
                fs.warn("grad", "a gradient left the flat gradient buffer (replaced, or freed by "
                        "zero_grad(set_to_none=True) and reallocated by autograd); it is copied back at "
                        "each fuse_step. Use optimizer.zero_grad(set_to_none=False) to keep it in place.")  # fmt: skip
            self.home_grads[i].copy_(g)
            p.grad = self.home_grads[i]
            self.grad_was_home[i] = True
        elif not _dense_contiguous(g):
            return None
        if not _dense_contiguous(p):
            return None
        return sig

    def _state_signature(self, i: int, p: torch.Tensor, state: dict) -> tuple | None:
        """Moves param i's per-element and 0-dim state into the bucket's buffers (with do_flatten);
        returns what a run's params must share (keys, kinds, dtypes, scalar values), or None when
        some state keeps the param out of runs."""
        fs = self.fs
        st = state.get(p)
        sig, joinable = [], True
        for k, v in (st.items() if st else ()):
            if self._is_flat_state(p, v):
                if fs.do_flatten:
                    home = self._state_home(k, i, v.dtype)
                    if home is None:
                        joinable = False
                        continue
                    if v.data_ptr() != home.data_ptr() or not v.is_contiguous():
                        if (k, i) in self.state_was_home and not fs.loading:
                            fs.warn("state", f"optimizer state {k!r} was reallocated outside the flat "
                                    "buffer; it was copied back", stacklevel=8)  # fmt: skip
                        home.copy_(v)
                        st[k] = home
                    self.state_was_home.add((k, i))
                elif not v.is_contiguous():
                    joinable = False
                    continue
                sig.append((k, "flat", st[k].dtype))
            elif isinstance(v, torch.Tensor):
                if v.numel() != 1 or v.requires_grad:
                    joinable = False  # state that is neither per element nor a scalar: update alone
                    continue
                if fs.do_flatten and v.dim() == 0:
                    self._scalar_to_home(st, k, i, v)
                    v = st[k]
                sig.append((k, "tensor", v.dtype, v.device, v.item()))
            else:
                try:
                    hash(v)
                except TypeError:
                    joinable = False
                    continue
                sig.append((k, "py", v))
        return tuple(sorted(sig, key=lambda e: e[0])) if joinable else None

    # -- after the optimizer's own step ------------------------------------------------------------
    def adopt(self, run: FlatRun, key: str, chunks: list[tuple[int, int, torch.Tensor]], state: dict) -> None:
        """The optimizer created flat state ``key`` for a run (its first step): copy it into the
        bucket's buffer (or one new tensor for the run without flattening) and point each
        parameter's state at its slice."""
        dtype = chunks[0][2].dtype
        if self.fs.do_flatten and self._state_home(key, run.i0, dtype) is not None:
            o = self.offsets[run.i0]
            target = self.state_bufs[key][o : o + run.numel]
            homes = self.state_homes[key][run.i0 : run.i1]
        else:
            target = torch.empty(run.numel, dtype=dtype, device=self.device)
            homes, o = [], 0
            for j in range(run.i0, run.i1):
                homes.append(target[o : o + self.numels[j]].view(self.shapes[j]))
                o += self.numels[j]
        for a, z, t in chunks:
            target[a:z].copy_(t.view(-1))
        for j, p in enumerate(run.params):
            state[p][key] = homes[j]
            self.state_was_home.add((key, run.i0 + j))
        self.dirty = True
