"""Several CPU processes for a benchmark, every collective they run counted and, on request, slowed down as if it
crossed a slow link: a process-group backend wrapped around gloo, and a launch of the ranks that cannot hang.

Why this module exists: torch.distributed counts no bytes, and a collective issued inside a library (DDP's gradient
buckets, an optimizer's all-reduce) cannot be wrapped from a training loop. A process-group *backend* sees all of
them: ``init_process_group(METERED_GLOO)`` makes the default group and every group created from it (``new_group``
with the parent's backend) a `MeteredGloo`, which hands each collective to an ordinary gloo process group after
noting, in the process's `Meter`, the operation, the bytes of the tensors this process hands in (its *payload*), and
the global ranks of the group. torch.distributed's documented extension point does the wiring
(``torch.distributed.Backend.register_backend``); nothing is patched.

The link model (`Link`): a collective of a group of n > 1 processes completes no sooner than ``latency_s +
wire_bytes / bandwidth`` after it was issued, where ``wire_bytes`` is what the process sends to the others on a
ring: 2 (n - 1) / n of the payload for an all-reduce, n - 1 times it for an all-gather (each process passes on every
other's piece), the payload less the part addressed to itself for an all-to-all, the payload for any other
collective (a broadcast, as its root sends it). The collective runs on gloo over loopback at once; waiting for it
(its work's ``wait()``, or its future) lasts until that delay has passed since it was issued. So a blocking
collective costs the whole delay, and one started in the background (``async_op=True``: streaming DiLoCo's
overlapped outer sync) costs only what is left of it when it is waited for, as over a real link. DDP's overlap of
its bucketed all-reduces with the rest of the backward pass is modelled the same way (with the tiny models of the
benchmarks, there is almost no backward left to overlap with).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: The name the metered backend is registered under (``init_process_group(METERED_GLOO)``).
METERED_GLOO = "metered_gloo"


@dataclasses.dataclass(frozen=True)
class Link:
    """A simulated link between the processes: each collective of a group of more than one process first waits
    ``latency_s`` plus the bytes this process sends divided by ``bandwidth`` (bytes per second; None: no limit)."""

    name: str
    latency_s: float = 0.0
    bandwidth: float | None = None

    def delay_s(self, wire_bytes: float) -> float:
        return self.latency_s + (wire_bytes / self.bandwidth if self.bandwidth else 0.0)

    def describe(self) -> str:
        if self.latency_s == 0 and self.bandwidth is None:
            return "no added delay (gloo over loopback)"
        return f"{self.latency_s * 1e3:g} ms + " + ("no bandwidth limit" if self.bandwidth is None else
                                                   f"{self.bandwidth / 1e6:g} MB/s")  # fmt: skip


#: Gloo over loopback as it is.
LOOPBACK = Link("loopback")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a process took part in: the operation, the payload it handed in (bytes), the global ranks of
    the group, the step of the loop it belongs to (`Meter.step`)."""

    op: str
    payload: int
    ranks: tuple[int, ...]
    step: int
    #: The bytes of the payload that stay with this process (an all-to-all's part addressed to itself).
    kept: int = 0

    @property
    def wire_bytes(self) -> float:
        """What this process sends to the others on a ring: 2 (n - 1) / n of the payload for an all-reduce over n
        processes, n - 1 times the payload for an all-gather, the payload less ``kept`` for an all-to-all, the payload
        for any other collective, nothing in a group of one."""
        n = len(self.ranks)
        if n == 1:
            return 0.0
        if self.op == "allreduce":
            return 2 * (n - 1) / n * self.payload
        if self.op == "allgather":
            return float((n - 1) * self.payload)
        return float(self.payload - self.kept)


class Meter:
    """What the metered groups of one process record, and the link they simulate; the loop sets ``step`` before each
    step and pauses the meter around its own bookkeeping collectives (timing barriers)."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        self.link = LOOPBACK
        self.step = -1
        self.collectives: list[Collective] = []
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are neither recorded nor delayed."""
        self._paused, before = True, self._paused
        try:
            yield
        finally:
            self._paused = before

    def note(self, op: str, tensors: Sequence[torch.Tensor], ranks: tuple[int, ...], kept: int = 0) -> float:
        """Record a collective; the ``time.monotonic()`` before which it may not complete (0: no delay)."""
        if self._paused:
            return 0.0
        collective = Collective(op, sum(t.numel() * t.element_size() for t in tensors), ranks, self.step, kept)
        self.collectives.append(collective)
        if len(ranks) > 1 and self.link is not LOOPBACK:
            return time.monotonic() + self.link.delay_s(collective.wire_bytes)
        return 0.0

    def clear(self) -> None:
        self.collectives = []


def _sleep_until(deadline: float) -> None:
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)


class DelayedWork(dist.Work):
    """A gloo collective's work that completes no sooner than the link's ``deadline`` (`Meter.note`): ``wait()``
    sleeps what is left of the delay, and so does the future (DDP's buckets wait on that) before it gives the
    collective's result."""

    def __init__(self, work: dist.Work, deadline: float) -> None:
        super().__init__()
        self.work, self.deadline = work, deadline

    def wait(self, timeout: Any = None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        _sleep_until(self.deadline)
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.monotonic() >= self.deadline

    def get_future(self) -> torch.futures.Future:
        def after_the_link(future: torch.futures.Future) -> Any:
            _sleep_until(self.deadline)
            return future.value()

        return self.work.get_future().then(after_the_link)


def _delayed(work: dist.Work, deadline: float) -> dist.Work:
    return DelayedWork(work, deadline) if deadline else work


class MeteredGloo(dist.ProcessGroup):
    """A process group that notes each collective in a `Meter` (and waits for its link), then runs it on gloo."""

    def __init__(self, options: Any, meter: Meter) -> None:
        super().__init__(options.group_rank, options.group_size)
        self.meter = meter
        self.ranks = tuple(options.global_ranks_in_group or range(options.group_size))
        # The run's timeout, whatever the group was created with: a subgroup created without one would wait 30 min.
        self.gloo = dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, meter.timeout)

    def getBackendName(self) -> str:  # noqa: N802 -- the name ProcessGroup's interface calls
        return METERED_GLOO

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        deadline = self.meter.note("allreduce", tensors, self.ranks)
        return _delayed(self.gloo.allreduce(tensors, *_given(opts)), deadline)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        deadline = self.meter.note("broadcast", tensors, self.ranks)
        return _delayed(self.gloo.broadcast(tensors, *_given(opts)), deadline)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        deadline = self.meter.note("allgather", inputs, self.ranks)
        return _delayed(self.gloo.allgather(outputs, inputs, *_given(opts)), deadline)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 -- the name ProcessGroup's interface uses
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        row = input.element_size() * (input[0].numel() if input.dim() else 1)
        own = input_split_sizes[self.rank()] if input_split_sizes else input.shape[0] // self.size()
        deadline = self.meter.note("alltoall", [input], self.ranks, kept=own * row)
        work = self.gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, *_given(opts))
        return _delayed(work, deadline)

    def barrier(self, opts: Any = None) -> Any:
        deadline = self.meter.note("barrier", [], self.ranks)
        return _delayed(self.gloo.barrier(*_given(opts)), deadline)


def _given(opts: Any) -> tuple[Any, ...]:
    return () if opts is None else (opts,)


def register_metered_gloo(meter: Meter) -> None:
    """Make ``init_process_group(METERED_GLOO)`` (and every ``new_group`` it parents) build `MeteredGloo` groups
    that record into ``meter``."""

    def create(options: Any, backend_options: Any) -> MeteredGloo:
        return MeteredGloo(options, meter)

    dist.Backend.register_backend(METERED_GLOO, create, extended_api=True, devices=["cpu"])


# ---- the launch ----


def _rank_main(
    rank: int, fn: Callable[..., None], world_size: int, rendezvous: str, timeout_s: float, args: tuple
) -> None:
    """One process: one thread (the ranks share the machine's cores), the metered default group, ``fn`` and, also
    when it raises, the end of the process group (gloo aborts at exit otherwise)."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    meter = Meter(timeout)
    register_metered_gloo(meter)
    dist.init_process_group(METERED_GLOO, init_method=rendezvous, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, meter, *args)
        dist.barrier()  # every rank done before any tears its connections down (gloo can abort at exit otherwise)
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., None],
    world_size: int,
    args: tuple = (),
    timeout_s: float = 600.0,
    collective_timeout_s: float = 60.0,
) -> None:
    """Run ``fn(rank, meter, *args)`` in ``world_size`` fresh processes (spawned: ``fn`` and ``args`` must pickle)
    over the metered gloo group; return when all are done.

    Nothing waits without bound: a rank that fails makes the others fail within ``collective_timeout_s`` (the
    collective timeout of every group) and the launch raises its error; past ``timeout_s`` for the whole launch every
    rank is killed and a TimeoutError says which launch and how long.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        rendezvous = f"file://{Path(folder) / 'rendezvous'}"
        context = mp.start_processes(
            _rank_main,
            args=(fn, world_size, rendezvous, collective_timeout_s, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{getattr(fn, '__name__', fn)} on {world_size} processes was not done after {timeout_s:g} s "
                        "(all killed); give the launch more time if the machine is busy"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
