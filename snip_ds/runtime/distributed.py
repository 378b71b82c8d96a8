"""Small collective helpers on compact statistics. Each does nothing when torch.distributed is not initialised."""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


# The tensors handed to this module's last collective, referenced until its next one. gloo's worker thread drops
# its own references to a finished collective's tensors a moment after the caller's wait returns; a tensor whose
# Python object the caller has freed by then is freed by that thread, which must take the GIL for it -- and
# during the interpreter's exit it cannot: the process aborts (seen once, a one-rank run whose last call was
# train_step's loss mean). Referenced here, they are freed by the next collective's caller, or by the interpreter
# itself at exit, long after the worker let go.
_LAST_HANDED: tuple = ()


def _handed(*tensors: Any) -> None:
    """Keeps the tensors (or lists of them) just handed to a collective referenced until the next one."""
    global _LAST_HANDED
    _LAST_HANDED = tensors


def _device(group: Any = None) -> torch.device:
    """The device collectives must use: CUDA for NCCL, CPU otherwise."""
    if is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_sum(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of ``t`` over ranks (a new tensor on ``t``'s device; ``t`` itself is not modified)."""
    if not is_initialized():
        return t.clone()
    buf = t.detach().to(_device(group), dtype=torch.float64 if t.is_floating_point() else t.dtype, copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    _handed(buf)
    return buf.to(t.device, t.dtype)


def dist_mean(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Mean of ``t`` over ranks."""
    return dist_sum(t, group) / world_size(group)


def dist_max_flag(flag: bool, group: Any = None) -> bool:
    """True on every rank if ``flag`` is true on any rank."""
    if not is_initialized():
        return flag
    buf = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_device(group))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    _handed(buf)
    return bool(buf.item())


def broadcast_json(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s JSON-able ``obj`` on every rank (sent as UTF-8 JSON bytes, never pickled).

    ``src`` is a rank within ``group`` (the default group's ranks are the global ranks).
    """
    if not is_initialized():
        return obj
    device = _device(group)
    root = src if group is None else dist.get_global_rank(group, src)  # dist.broadcast takes a global rank
    payload = json.dumps(obj, sort_keys=True).encode() if rank(group) == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=root, group=group)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if rank(group) == src:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=root, group=group)
    _handed(size, buf)
    return json.loads(buf.cpu().numpy().tobytes().decode())


def agree(text: str, group: Any = None) -> bool:
    """Whether every rank holds the same ``text`` (compared by a 63-bit hash: min == max)."""
    if not is_initialized():
        return True
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    lo = torch.tensor([h], dtype=torch.int64, device=_device(group))
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    _handed(lo, hi)
    return bool(lo.item() == hi.item() == h)


def all_gather_json(obj: Any, group: Any = None) -> list:
    """Every rank's JSON-able ``obj``, in rank order, on every rank (UTF-8 JSON bytes, never pickled)."""
    if not is_initialized():
        return [obj]
    device = _device(group)
    payload = json.dumps(obj, sort_keys=True).encode()
    n = world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    mine = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.all_gather(sizes, mine, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        buf[:len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    _handed(sizes, mine, bufs, buf)
    return [json.loads(b[:int(s.item())].cpu().numpy().tobytes().decode()) for b, s in zip(bufs, sizes)]


def first_error(message: str | None, group: Any = None) -> str | None:
    """The first (lowest rank's) non-empty ``message`` of any rank, on every rank; ``None`` when no rank has one.

    Every rank must call it at the same point, before any other collective that a failed rank would skip.
    """
    return next((m for m in all_gather_json(message or None, group) if m), None)


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank died (its connections closed) or
    stopped answering (the process group's timeout)."""
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and "gloo/transport" in str(err))


def lost_peer_line(err: BaseException, resume_hint: str) -> str:
    """The one ``error:`` line a rank prints when :func:`lost_peer` says ``err`` is one."""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"error: rank {rank()}: a collective failed, another rank died or stopped answering ({detail}); the "
            f"job cannot go on: {resume_hint}")

