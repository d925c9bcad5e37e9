"""DiLoCo's outer loop: the pseudo-gradient, its deterministic average, and the outer Nesterov step.

Every host and the aggregator must compute the same new global model bit for bit (so a host can check
the checkpoint hash posted on chain). Three rules make that hold on any CPU or GPU:

1. Everything is fp32 and every tensor operation used here is a single IEEE-754 operation with one
   rounding (add, sub, mul), which every backend implements exactly.
2. No fused kernels whose rounding depends on the machine. `torch.add(x, y, alpha=a)` is one fused
   multiply-add on AVX2/AVX-512/NEON/CUDA but two roundings on a plain build; so the outer step computes
   fused multiply-adds itself, exactly (`fma32`): the product of two fp32 numbers is exact in fp64, and
   the fp64 sum is rounded *to odd* before the final rounding to fp32, which makes that double rounding
   equal to a single correct rounding (Boldo & Melquiond, 2008). On the CPU the same bits come ~10×
   faster: the plain fp64 sum rounded to fp32 is already the correct result except where it lands
   exactly on an fp32 tie (or in fp32's subnormal range), and only those elements take the round-to-odd
   path (`_fma32_cpu`). That is precisely what
   `torch.optim.SGD(nesterov=True, foreach=False)` computes on an FMA machine, so the two agree bit for
   bit there, and ours also agrees with itself on machines that have no FMA.
3. A fixed order: parameters in sorted name order, contributions in strictly increasing host order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from training.cpu_pool import map_parts, workers_for

_FMA_CHUNK = 1 << 20  # elements per fp64 temporary: bounds the outer step's extra memory to a few MiB


SQUARES_SLICE = 1 << 16  # elements per fp32 dot product of `sum_of_squares`


def sum_of_squares(t: Tensor) -> float:
    """Σ x² of `t`'s entries, for a pseudo-gradient's norm (a sanity figure in reports): fp32 dot products
    of 64k-element slices, summed as Python floats, so the rounding error stays near fp32's relative
    precision at any size without an fp64 copy of the tensor (which took 4.8 s for 1.2B parameters here,
    on a host's training path; this reads the tensor once: ~1.4 s at 1.2B on 2 cores, scripts/bench_wan.py's
    seal, unless `add_measuring` does it while the tensor is read anyway)."""
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    return math.fsum(float(torch.dot(s, s)) for s in flat.split(SQUARES_SLICE))


def add_measuring(t: Tensor, other: Tensor, scale: float = 1.0) -> float:
    """t += scale·other in place, slice by slice, returning `sum_of_squares(t)` of `t` as it was: each
    slice's dot product taken while the slice is in cache for its add, so Δ's norm costs no pass of its
    own over memory (error feedback adds the residual to the pseudo-gradient it consumes). Each element is
    the same fp32 operation as one `t += other` (`scale` ≠ 1: `other * scale` first, as one would), and
    the sum is `sum_of_squares`' to the bit (the same slices, the same order). Both fp32, contiguous."""
    if t.dtype != torch.float32 or other.dtype != torch.float32 or t.shape != other.shape or \
            not (t.is_contiguous() and other.is_contiguous()):
        raise ValueError("add_measuring: two contiguous fp32 tensors of one shape")
    dots = []
    for part, add in zip(t.view(-1).split(SQUARES_SLICE), other.view(-1).split(SQUARES_SLICE), strict=True):
        dots.append(float(torch.dot(part, part)))
        part.add_(add if scale == 1.0 else add * torch.tensor(scale, dtype=torch.float32))
    return math.fsum(dots)


def pseudo_gradient(
    global_params: Mapping[str, Tensor], local_params: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Δ = θ_global − θ_local in fp32, one tensor per parameter name (the outer optimizer's gradient)."""
    _check_same_keys(global_params, local_params, "local_params")
    delta: dict[str, Tensor] = {}
    for name in sorted(global_params):
        g, loc = global_params[name], local_params[name]
        if g.shape != loc.shape:
            raise ValueError(
                f"pseudo_gradient: {name} has shape {tuple(loc.shape)}, expected {tuple(g.shape)}"
            )
        delta[name] = g.detach().float() - loc.detach().to(device=g.device, dtype=torch.float32)
    return delta


def fma32(a: Tensor, b: Tensor | float, c: Tensor) -> Tensor:
    """a·b + c for fp32 tensors with a single rounding (IEEE fusedMultiplyAdd), identically on any device.

    `b` may be a tensor of a's shape or a scalar (taken as the nearest fp32, as torch does for `alpha`).
    On the CPU the fast path (`_fma32_cpu`) gives the very same bits as the reference (`fma32_reference`).
    """
    a, c = a.float(), c.float()
    # pragma: no mutate start (a CPU tensor gets the same bits down either branch, and only a GPU takes the
    # reference here: every mutant of these two lines is equivalent on a CPU-only run; docs/benchmarks.md)
    if a.device.type != "cpu" or c.device.type != "cpu" or (isinstance(b, Tensor) and b.device.type != "cpu"):
        return fma32_reference(a, b, c)
    # pragma: no mutate end
    return _fma32_cpu(a, b, c)


def fma32_reference(a: Tensor, b: Tensor | float, c: Tensor) -> Tensor:
    """`fma32` the plain way on any device: the exact fp64 product, summed rounding to odd, then rounded
    to fp32 (round to odd in fp64 makes the second rounding equal to a single correct one)."""
    a, c = a.float(), c.float()
    out = torch.empty_like(c)
    a_flat, c_flat, o_flat = a.reshape(-1), c.reshape(-1), out.view(-1)
    b_flat = b.float().reshape(-1) if isinstance(b, Tensor) else None
    b_scalar = float(torch.tensor(b, dtype=torch.float32)) if b_flat is None else 0.0
    for start in range(0, c_flat.numel(), _FMA_CHUNK):
        sl = slice(start, start + _FMA_CHUNK)
        prod = a_flat[sl].double() * (b_flat[sl].double() if b_flat is not None else b_scalar)  # exact
        o_flat[sl] = _round_to_odd_sum(prod, c_flat[sl].double()).float()
    return out


# The CPU path works in blocks small enough that its fp64 scratch stays in cache, with buffers allocated
# once per call and every operation in place, split over torch's threads.
_BLOCK = 1 << 16  # elements: 2 fp64 + 1 int64 scratch buffers of 512 KiB stay in a 2 MiB L2
_MID_MASK = (1 << 29) - 1  # the 29 fp64 mantissa bits below fp32's 23
_MID = 1 << 28  # those bits of an fp64 number halfway between two fp32 numbers
_FP32_TINY = 2.0**-126  # below it fp32 is subnormal, with a coarser grid than _MID assumes


def _fma32_cpu(a: Tensor, b: Tensor | float, c: Tensor) -> Tensor:
    """`fma32` on the CPU: s = a·b + c in fp64 (the product exact, the sum rounded once), then s → fp32.
    That double rounding differs from a single one only when s lands exactly halfway between two fp32
    numbers (every fp32 number and midpoint is an fp64 number, and rounding is monotone), so only such
    elements, and fp32-subnormal ones, are recomputed by the reference: the result is bit-identical."""
    out = torch.empty_like(c)
    a_flat, c_flat, o_flat = a.reshape(-1), c.reshape(-1), out.view(-1)
    b_flat = b.float().reshape(-1) if isinstance(b, Tensor) else None
    b_scalar = float(torch.tensor(b, dtype=torch.float32)) if b_flat is None else 0.0
    n = c_flat.numel()
    share = -(-n // (workers_for(n, _BLOCK) * _BLOCK)) * _BLOCK  # whole blocks per thread
    parts = [(start, min(start + share, n)) for start in range(0, n, share)] if n else []

    def run(part: tuple[int, int]) -> None:
        with torch.no_grad():
            _fma32_blocks(a_flat, b_flat, b_scalar, c_flat, o_flat, *part)

    map_parts(run, parts)
    return out


def _fma32_blocks(
    a: Tensor, b: Tensor | None, b_scalar: float, c: Tensor, out: Tensor, start: int, stop: int
) -> None:
    s = torch.empty(_BLOCK, dtype=torch.float64)
    t = torch.empty(_BLOCK, dtype=torch.float64)
    bits = torch.empty(_BLOCK, dtype=torch.int64)
    odd = torch.empty(_BLOCK, dtype=torch.bool)
    tiny = torch.empty(_BLOCK, dtype=torch.bool)
    for lo in range(start, stop, _BLOCK):
        hi = min(lo + _BLOCK, stop)
        k = hi - lo
        sk, tk, bk, ok, yk = s[:k], t[:k], bits[:k], odd[:k], tiny[:k]
        sk.copy_(a[lo:hi])
        if b is None:
            sk.mul_(b_scalar)  # exact: 24 × 24 bits fit fp64's 53
        else:
            tk.copy_(b[lo:hi])
            sk.mul_(tk)
        tk.copy_(c[lo:hi])
        sk.add_(tk)
        out[lo:hi].copy_(sk)
        torch.bitwise_and(sk.view(torch.int64), _MID_MASK, out=bk)
        torch.eq(bk, _MID, out=ok)
        torch.abs(sk, out=tk)
        torch.lt(tk, _FP32_TINY, out=yk)
        if bool(yk.any()):  # exact zeros need no care (and sparse updates have many)
            yk.logical_and_(tk != 0)
        ok.logical_or_(yk)
        if bool(ok.any()):  # rare: a midpoint, or fp32-subnormal
            idx = ok.nonzero().squeeze(1).add_(lo)
            bi = b[idx] if b is not None else b_scalar
            out[idx] = fma32_reference(a[idx], bi, c[idx])


def _round_to_odd_sum(x: Tensor, y: Tensor) -> Tensor:
    """x + y in fp64 rounded to odd: exact if representable, else the neighbour whose last bit is 1."""
    s = x + y
    # TwoSum (Knuth): err is exactly (x + y) − s, so we know which side of s the true sum lies on.
    y_virtual = s - x
    err = (x - (s - y_virtual)) + (y - y_virtual)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, math.inf, -math.inf).to(s.dtype)
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s)


class StreamingAverager:
    """Weighted mean of pseudo-gradients, accumulated one contribution at a time in fp32.

    Memory is one model however many hosts contribute. Floating-point addition is not associative, so
    the order is part of the result: contributions must arrive in strictly increasing `key` order
    (the aggregator uses the host's lower-case 0x address). The mean is
    `(Σ_i fp32(w_i)·Δ_i) · fp32(1 / Σ_i w_i)`, each operation rounded once, summed in key order.
    """

    def __init__(self, spec: Mapping[str, tuple[int, ...]], device: torch.device | str = "cpu") -> None:
        self._spec = {name: tuple(shape) for name, shape in spec.items()}
        self._sum = {
            name: torch.zeros(shape, dtype=torch.float32, device=device) for name, shape in self._spec.items()
        }
        self._total_weight = 0.0
        self._last_key: str | None = None
        self._spent = False  # take_result() handed the sums out as the mean
        self.keys: list[str] = []

    def add(self, key: str, delta: Mapping[str, Tensor], weight: float = 1.0) -> None:
        """Accumulate one host's decoded pseudo-gradient; checks everything before changing any state."""
        self._check_key(key, weight)
        _check_same_keys(self._spec, delta, f"delta from {key!r}")
        for name in self._spec:
            self._check_shape(key, name, delta[name])
        self._accumulate(key, ((name, delta[name]) for name in sorted(self._spec)), weight)

    def add_parts(self, key: str, parts: Iterable[tuple[str, Tensor]], weight: float = 1.0) -> None:
        """`add` fed one tensor at a time (a payload decoded tensor by tensor holds one decoded tensor, not
        the whole update), the same sums bit for bit: each tensor's sum is its own, whatever the order.
        The key, the weight and each tensor's name and shape are checked before it is added; a stream
        that fails part way leaves some tensors added, so the averager must then be dropped (the
        aggregator's close starts again from its files)."""
        self._check_key(key, weight)
        seen: set[str] = set()

        def checked() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in parts:
                if name not in self._spec or name in seen:
                    raise ValueError(f"StreamingAverager.add_parts: {key!r} sent {name!r} "
                                     f"{'twice' if name in seen else 'which the model does not have'}")
                self._check_shape(key, name, tensor)
                seen.add(name)
                yield name, tensor
            _check_same_keys(self._spec, dict.fromkeys(seen), f"delta from {key!r}")

        self._accumulate(key, checked(), weight)

    def _check_key(self, key: str, weight: float) -> None:
        if self._spent:
            raise ValueError("StreamingAverager.add: take_result() already spent this averager")
        if self._last_key is not None and key <= self._last_key:
            raise ValueError(
                f"StreamingAverager.add: key {key!r} is not after {self._last_key!r}; add contributions in sorted order"
            )
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"StreamingAverager.add: weight for {key!r} must be finite and > 0, got {weight}"
            )

    def _check_shape(self, key: str, name: str, tensor: Tensor) -> None:
        if tuple(tensor.shape) != self._spec[name]:
            raise ValueError(
                f"StreamingAverager.add: {key!r} sent {name} with shape {tuple(tensor.shape)}, expected {self._spec[name]}"
            )

    def _accumulate(self, key: str, parts: Iterable[tuple[str, Tensor]], weight: float) -> None:
        w = torch.tensor(weight, dtype=torch.float32)
        for name, tensor in parts:
            d = tensor.to(device=self._sum[name].device, dtype=torch.float32)
            self._sum[name].add_(d if weight == 1.0 else d * w.to(d.device))
        self._total_weight += float(w)
        self._last_key = key
        self.keys.append(key)

    def result(self) -> dict[str, Tensor]:
        """The weighted mean (new tensors); the averager can keep accumulating afterwards."""
        inv = self._inverse_weight()
        return {name: self._sum[name] * inv.to(self._sum[name].device) for name in sorted(self._sum)}

    def take_result(self) -> dict[str, Tensor]:
        """`result()` computed in the sums' own memory (the same values: one rounding each), so the mean
        costs no second model; the averager is spent afterwards."""
        inv = self._inverse_weight()
        out = {name: self._sum[name].mul_(inv.to(self._sum[name].device)) for name in sorted(self._sum)}
        self._sum, self._spent = {}, True
        return out

    def _inverse_weight(self) -> Tensor:
        if not self.keys:
            raise ValueError("StreamingAverager.result: no contributions were added")
        if self._spent:
            raise ValueError("StreamingAverager.result: take_result() already spent this averager")
        return torch.tensor(1.0 / self._total_weight, dtype=torch.float32)


def average(deltas: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Unweighted mean of pseudo-gradients keyed by host, accumulated in sorted key order."""
    if not deltas:
        raise ValueError("average: no pseudo-gradients given")
    first = deltas[min(deltas)]
    avg = StreamingAverager(
        {n: tuple(t.shape) for n, t in first.items()}, device=next(iter(first.values())).device
    )
    for key in sorted(deltas):
        avg.add(key, deltas[key])
    return avg.result()


class OuterOptimizer:
    """SGD with (Nesterov) momentum applied to the averaged pseudo-gradient, bit-exact on any machine.

    Same semantics as `torch.optim.SGD(lr, momentum, nesterov, dampening=0, weight_decay=0)`:
    first step buf = g, later buf = μ·buf + g; update = g + μ·buf (Nesterov) or buf; p ← p − lr·update.
    The multiply-adds that torch fuses are computed as exact fused multiply-adds (`fma32`).
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"OuterOptimizer: lr must be finite and > 0, got {lr}")
        if not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"OuterOptimizer: momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0.0:
            raise ValueError("OuterOptimizer: Nesterov needs momentum > 0 (as in torch.optim.SGD)")
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.steps = 0
        self.buffers: dict[str, Tensor] = {}

    def step(self, params: Mapping[str, Tensor], avg_delta: Mapping[str, Tensor]) -> None:
        """Update `params` in place (fp32 tensors) with the averaged pseudo-gradient, in sorted name order."""
        self._check_step(params, avg_delta)
        for name in sorted(params):
            self._step_tensor(name, params[name], avg_delta[name])
        self.steps += 1

    def _step_tensor(self, name: str, p: Tensor, g: Tensor) -> None:
        """One parameter's step, in place, its momentum buffer replaced (never written: a copy of this
        optimizer may share it). Element by element: element i of the result depends on element i of
        `p`, `g` and the buffer alone, which `SpeculativeStep` relies on."""
        g = g.to(device=p.device, dtype=torch.float32)
        update = g
        with torch.no_grad():  # p may be a model's leaf parameter, updated in place
            if self.momentum != 0.0:
                buf = self.buffers.get(name)
                mu = torch.tensor(self.momentum, dtype=torch.float32, device=g.device)
                # torch: buf = g first, then buf.mul_(μ).add_(g): two roundings (alpha=1 fuses nothing).
                buf = g.clone() if buf is None else torch.mul(buf, mu).add_(g)
                self.buffers[name] = buf
                update = fma32(buf, self.momentum, g) if self.nesterov else buf
            p.copy_(fma32(update, -self.lr, p))

    def copy(self) -> OuterOptimizer:
        """Another optimizer in this one's state, sharing its buffer tensors (a step replaces a buffer
        rather than writing it, so neither optimizer's steps change the other's state)."""
        other = OuterOptimizer(self.lr, self.momentum, self.nesterov)
        other.steps, other.buffers = self.steps, dict(self.buffers)
        return other

    def _check_step(self, params: Mapping[str, Tensor], avg_delta: Mapping[str, Tensor]) -> None:
        """Everything `step` needs, checked before any tensor or buffer changes."""
        _check_same_keys(params, avg_delta, "avg_delta")
        for name in sorted(params):
            p, g = params[name], avg_delta[name]
            buf = self.buffers.get(name)
            if p.dtype != torch.float32 or g.shape != p.shape or (buf is not None and buf.shape != p.shape):
                raise ValueError(
                    f"OuterOptimizer.step: {name} must be fp32 with shape {tuple(p.shape)} (got {p.dtype}, {tuple(g.shape)})"
                )
            # All finite iff the fp64 sum is: finite fp32 values cannot overflow it, and a NaN or an
            # infinity survives it (inf − inf is NaN). Cheaper than a mask of the whole tensor.
            if not math.isfinite(float(g.sum(dtype=torch.float64))):
                raise ValueError(
                    f"OuterOptimizer.step: the averaged pseudo-gradient of {name} has NaN or infinity"
                )

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "steps": self.steps,
            "momentum_buffer": {name: buf.clone() for name, buf in sorted(self.buffers.items())},
        }

    def restore(self, steps: int, buffers: Mapping[str, Tensor]) -> None:
        """Continue from saved momentum (`steps` taken, their buffers) under this optimizer's hyperparameters:
        what the aggregator and a host keep on disk between rounds."""
        self.load_state_dict(
            {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov, "steps": steps, "momentum_buffer": buffers}
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a saved state; hyperparameters must match (a mismatch is a configuration mistake)."""
        for field in ("lr", "momentum", "nesterov"):
            if state.get(field) != getattr(self, field):
                raise ValueError(
                    f"OuterOptimizer.load_state_dict: saved {field}={state.get(field)!r}, this optimizer has {getattr(self, field)!r}"
                )
        buffers = state.get("momentum_buffer")
        if not isinstance(buffers, Mapping) or not all(
            isinstance(b, Tensor) and b.dtype == torch.float32 for b in buffers.values()
        ):
            raise ValueError("OuterOptimizer.load_state_dict: momentum_buffer must map names to fp32 tensors")
        self.steps = int(state["steps"])
        self.buffers = {name: buf.clone() for name, buf in buffers.items()}


# An outer step's update: dense tensors, or per name (flat positions, values there) with +0 elsewhere.
Update = Mapping[str, Tensor] | Mapping[str, tuple[Tensor, Tensor]]


class SpeculativeStep:
    """An outer step taken before its update is known, finished on the update's nonzero entries alone.

    `run` steps copies of the model and the momentum as if every entry of the update were +0; `finish`
    then recomputes, from the untouched base, only the entries where the update is not +0 (bit pattern
    0; −0 and NaN count as nonzero) and writes them over the copies. Every operation of the outer step
    is element by element (`OuterOptimizer._step_tensor`), so the result is bit for bit the step taken
    with the update, while the dense part of the work runs before the update exists: a host computes it
    while its upload is in flight, and with a sparse broadcast (top-k: 3 % of the entries) only a few
    percent of a step is left for when the round's update arrives (docs/PROTOCOL.md "Overlapped
    rounds"). The base's tensors and buffers must not change until `finish` returns; they are never
    written here.
    """

    def __init__(self, outer: OuterOptimizer, params: Mapping[str, Tensor]) -> None:
        for name, t in params.items():
            if t.dtype != torch.float32:
                raise ValueError(f"SpeculativeStep: {name} must be fp32 (got {t.dtype})")
        self._base, self._base_outer = dict(params), outer
        self.params: dict[str, Tensor] = {}
        self.outer = outer.copy()
        self.done = False
        self._forecast: dict[str, tuple[Tensor, Tensor]] | None = None  # positions a forecast wrote, what was there
        self.finished = False  # once finished, the base is let go of (the result no longer needs it)
        # the next step's +0 part (`take_after`), and the positions `finish` and a forecast wrote (`after_finish`)
        self._after: tuple[dict[str, Tensor], OuterOptimizer] | None = None
        self._changed: dict[str, list[Tensor]] = {}

    def run(self, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """The step with an all +0 update, tensor by tensor; False when `cancelled()` stopped it first."""
        if self.finished:
            raise RuntimeError("SpeculativeStep.run: finished already (its optimizer is the model's now)")
        zero = torch.zeros((), dtype=torch.float32, device=self._device())
        for name in sorted(self._base):
            if cancelled():
                return False
            if name not in self.params:
                base = self._base[name]
                p = base.detach().clone(memory_format=torch.contiguous_format)
                self.outer._step_tensor(name, p, zero.expand(base.shape))  # one +0 read everywhere: no memory
                self.params[name] = p
        self.outer.steps = self._base_outer.steps + 1
        self.done = True
        return True

    def finish(self, update: Update) -> tuple[dict[str, Tensor], OuterOptimizer]:
        """(the stepped model, the stepped optimizer): exactly `outer.step(params, update)` on copies of
        the base, written over this speculation's own tensors, or over a copy of them after a `forecast`
        (which a round is training from). Finish once. Raises ValueError, changing nothing, for an update
        `OuterOptimizer.step` would refuse."""
        if self.finished:
            raise RuntimeError("SpeculativeStep.finish: finished already (its tensors are the model's now)")
        where, params, buffers = self._entries(update)
        after = self._after is not None  # the positions written are kept for `after_finish` only
        self._changed = {name: [idx] for name, idx in where.items()} if after else {}
        if self._forecast is not None:
            undo, self._forecast = self._forecast, None
            self.params = {name: t.clone() for name, t in self.params.items()}
            for name, (idx, before) in undo.items():
                self.params[name].view(-1)[idx] = before
                if after:
                    self._changed.setdefault(name, []).append(idx)
        for name, idx in where.items():
            self.params[name].view(-1)[idx] = params[name]
            if name in buffers:  # `run` made every buffer anew: written here, they are this step's alone
                self.outer.buffers[name].view(-1)[idx] = buffers[name]
        self.finished = True
        self._base, self._base_outer = {}, OuterOptimizer(self.outer.lr, self.outer.momentum, self.outer.nesterov)
        return self.params, self.outer

    def take_after(self, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """The next outer step's +0 part taken before this step's update is known: the +0 step of this
        step's +0 model and momentum (read where a `forecast` wrote over the model too), which
        `after_finish` fixes at the few entries the update and the forecast changed: a host takes it while
        its upload is in flight (docs/PROTOCOL.md). False when `cancelled()` stopped it. Before `finish`;
        this step's tensors are only read."""
        if self.finished:
            raise RuntimeError("SpeculativeStep.take_after: finished already")
        if not self.done:
            self.run()
        after = self.outer.copy()  # shares the buffers, which its steps replace and never write
        zero = torch.zeros((), dtype=torch.float32, device=self._device())
        params: dict[str, Tensor] = {}
        for name in sorted(self.params):
            if cancelled():
                return False
            p = self.params[name].detach().clone(memory_format=torch.contiguous_format)
            after._step_tensor(name, p, zero.expand(p.shape))
            params[name] = p
        after.steps = self.outer.steps + 1
        self._after = (params, after)
        return True

    def after_finish(self) -> SpeculativeStep | None:
        """Once finished: `SpeculativeStep(outer, model).run()` of this step's result, bit for bit, from
        `take_after`'s, each entry `finish` or a forecast wrote taken again from the finished model and
        momentum (element by element). None without `take_after`. Once: its tensors are the new step's."""
        if not self.finished:
            raise RuntimeError("SpeculativeStep.after_finish: the step is not finished")
        if self._after is None:
            return None
        (params, after), self._after = self._after, None
        for name, parts in self._changed.items():
            idx = torch.cat(parts) if len(parts) > 1 else parts[0]
            if not idx.numel():
                continue
            sub = OuterOptimizer(after.lr, after.momentum, after.nesterov)
            sub.steps = self.outer.steps
            if name in self.outer.buffers:
                sub.buffers[name] = self.outer.buffers[name].reshape(-1)[idx]
            values = self.params[name].reshape(-1)[idx]
            sub._step_tensor(name, values, torch.zeros_like(values))
            params[name].view(-1)[idx] = values
            if name in sub.buffers:  # `take_after`'s steps made its buffers anew: this step's alone
                after.buffers[name].view(-1)[idx] = sub.buffers[name]
        self._changed = {}
        step = SpeculativeStep(self.outer, self.params)
        step.params, step.outer, step.done = params, after, True
        return step

    def forecast(self, update: Update) -> dict[str, Tensor]:
        """The model `finish(update)` would give, written over this speculation's own model tensors (what
        `finish` later starts from a copy of, with these entries undone): an eager host's forecast of the
        round's model from its own payload costs only the payload's entries (training/overlap.py). The
        returned tensors stay as they are from then on. Once, before `finish`."""
        if self._forecast is not None or self.finished:
            raise RuntimeError("SpeculativeStep.forecast: a forecast was taken already, or the step finished")
        where, params, _ = self._entries(update)
        undo = {name: (idx, self.params[name].view(-1)[idx]) for name, idx in where.items()}  # gathers copy
        for name, idx in where.items():
            self.params[name].view(-1)[idx] = params[name]
        self._forecast = undo
        return dict(self.params)

    def forecast_shift(self) -> dict[str, Tensor]:
        """After `forecast`: the forecast less the +0 model it was written over, as `shift_onto` takes it
        (fp32, one rounding): the differences at the forecast's positions, +0 elsewhere (x − x, x finite),
        which a round started from the +0 model adds to move onto the forecast (`worker.Shifted`)."""
        if self._forecast is None:
            raise RuntimeError("SpeculativeStep.forecast_shift: no forecast was taken")
        shift: dict[str, Tensor] = {}
        for name, p in self.params.items():
            out = shift[name] = torch.zeros_like(p)
            if name in self._forecast:
                idx, before = self._forecast[name]
                out.view(-1)[idx] = p.view(-1)[idx] - before
        return shift

    @property
    def forecasted(self) -> bool:
        """Whether `forecast` was taken (and `finish` not yet)."""
        return self._forecast is not None

    def steps_from(self, params: Mapping[str, Tensor]) -> bool:
        """Whether this speculation was taken from these very tensors (not copies, not other ones)."""
        return params.keys() == self._base.keys() and all(params[n] is t for n, t in self._base.items())

    def _entries(self, update: Update) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """(per name: the flat positions where `update` is not +0, the model's and the momentum's values
        there after the step with `update`), computed from the base by `OuterOptimizer.step` itself."""
        if not self.done:
            self.run()
        _check_same_keys(self._base, update, "SpeculativeStep: update")
        names = sorted(self._base)
        values: dict[str, Tensor] = {}
        where: dict[str, Tensor] = {}
        for name in names:
            where[name], values[name] = self._positions(name, update[name])
        # The same step on the gathered entries: it checks the values (NaN, infinity: all among them) and
        # raises before anything here is written.
        sub = OuterOptimizer(self.outer.lr, self.outer.momentum, self.outer.nesterov)
        sub.steps = self._base_outer.steps
        sub.buffers = {name: buf.reshape(-1)[where[name]] for name, buf in self._base_outer.buffers.items()}
        params = {name: self._base[name].reshape(-1)[where[name]] for name in names}
        sub.step(params, values)
        return where, params, sub.buffers

    def _positions(self, name: str, g: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """(flat positions, fp32 values) of one tensor's update: a dense fp32 tensor's entries that are not
        +0, or a sparse one's, checked against the parameter. Sparse positions must be distinct (as
        `Codec.decode_sparse` gives them; not checked here: that would sort them on the training path)."""
        base = self._base[name]
        if isinstance(g, Tensor):
            if g.shape != base.shape or g.dtype != torch.float32:
                raise ValueError(f"SpeculativeStep: update {name} is {g.dtype} of shape {tuple(g.shape)}, "
                                 f"expected torch.float32 of shape {tuple(base.shape)}")
            flat = g.detach().to(device=base.device).reshape(-1)
            idx = flat.view(torch.int32).nonzero().squeeze(1)  # +0 is the only all-zero bit pattern
            return idx, flat[idx]
        idx, vals = g
        if idx.dim() != 1 or vals.shape != idx.shape or idx.dtype != torch.int64 or \
                (idx.numel() and not (int(idx.min()) >= 0 and int(idx.max()) < base.numel())):
            raise ValueError(f"SpeculativeStep: sparse update {name} must be int64 positions in "
                             f"[0, {base.numel()}) with one value each")
        return idx.to(base.device), vals.detach().to(device=base.device, dtype=torch.float32)

    def _device(self) -> torch.device:
        return next(iter(self._base.values())).device if self._base else torch.device("cpu")


def _check_same_keys(expected: Mapping[str, Any], got: Mapping[str, Any], what: str) -> None:
    if set(expected) != set(got):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise ValueError(f"{what}: parameter names differ (missing {missing[:5]}, unexpected {extra[:5]})")
