"""The outer sync on torchft: DiLoCo and GPA across replica groups that go on when one is lost and heal one that
(re)joins.

torchft (PyTorch's fault-tolerant training, ``pip install "hf_gpa[torchft]"``) keeps the *quorum* of the replica
groups in a lighthouse (``torchft_lighthouse``); each group's ``torchft.Manager`` runs collectives that survive a lost
peer, and a group that starts or restarts fetches its state from a live one. `TorchftSync` is the outer sync of a
`DiLoCo` or `GPADiLoCo` (their ``sync=`` argument) over a Manager: the algorithms are the same objects and their
outer steps the same code; only the average of the pseudo-gradients, and what happens around it, is torchft's. Each
replica group is one worker of one process.

One outer sync:

1. a quorum from the lighthouse (``start_quorum``): a group lost since the last sync is left out once its
   heartbeats have stopped for the lighthouse's ``--heartbeat_timeout_ms``;
2. the sum of the pseudo-gradients (``manager.allreduce``), one flat bucket per (device, dtype) as the
   torch.distributed sync sends them, and of a count: a group that took this period's inner steps sends its
   pseudo-gradients and 1, a group that joins or has healed sends zeros and 0;
3. ``should_commit``: the groups agree that nothing failed. Where something did (a peer died inside the collective, a
   heal failed), a new quorum is taken and the same pseudo-gradients are sent again (the inner weights have not
   moved; no period of work is thrown away), at most ``max_retries`` times;
4. the sums divided by the count M: the average over the groups that did the period; every group takes the
   algorithm's outer step with the same bits.

With no failure this is bitwise the average of the torch.distributed sync (the same gloo sum of the same buckets in
the same rank order, divided by the same M), so the run is our own run across workers: the engine changes only what
happens on a failure.

**Joining** (`TorchftSync.join`, once, after the optimizer, the lr scheduler and whatever else must heal are built):
one outer sync of every parameter in which this group sends nothing. At a fresh start every group joins together and
all but the first heal from it (torchft's ``init_sync``), so every group starts from the first group's weights, as the
broadcast at construction does across processes; no outer step is taken (M = 0). A group that starts late or restarts
joins its peers' next outer sync: it heals from one of them (`checkpoint.served_state`: the inner weights, the outer
state, DiLoCo's momentum or GPA's x and z, the base optimizer's state, the param groups' values with ``inner_step``,
which is also the data position, and the traffic; plus whatever `TorchftSync.heal_also` registered, such as the lr
scheduler), then takes the same outer step with the same average and holds exactly what they hold.

Why not torchft's own ``torchft.local_sgd.DiLoCo`` with our outer step as its outer optimizer: it discards the period
of a sync whose commit fails (we send it again), it needs the synchronous quorum, in which a healing group takes part
with a copy of its source's inner weights (that group's pseudo-gradients then count twice), its per-tensor or 1 GiB
buckets would average to other bits than our run, and our outer steps would need a second form as a
``torch.optim.Optimizer`` over the outer weights. Here they keep their one implementation.

torchft is imported only inside the functions that need it (`require_torchft`): ``hf_gpa.optim`` stays torch-only.
This module lives with the other syncs (``sync.py``) because it is one more of them: what crosses the wire and how.
What it does not do yet (``rules.TORCHFT_NOT_YET``): several processes per replica group, streaming fragments, a
compressed or overlapped sync.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import socket
import time
from typing import Any

import torch

from .._types import INNER_STEP, OUTER
from . import checkpoint, rules
from .compression import outer_sent_bytes
from .layout import WorkerLayout, flat_buckets
from .sync import Due, OuterSync, PendingSync

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_QUORUM_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "OPTIMIZER_KEY",
    "SyncRecord",
    "TorchftSync",
    "replica_group_id",
    "require_torchft",
]

logger = logging.getLogger(__name__)

#: The Manager's timeout of a collective, a commit vote and a heal's transfer (torchft's default).
DEFAULT_TIMEOUT_S = 60.0
#: How long a group waits for its quorum. A group that (re)joins waits for its peers' next outer sync, up to one
#: period of H inner steps, so this must exceed a period; a lighthouse that is gone is found this late.
DEFAULT_QUORUM_TIMEOUT_S = 300.0
#: How long the Manager tries to reach the lighthouse when it is built.
DEFAULT_CONNECT_TIMEOUT_S = 30.0
#: How many times a sync whose commit failed is sent again with a new quorum before the run stops.
DEFAULT_MAX_RETRIES = 3
#: The Manager's key of the optimizer's served state (`checkpoint.served_state`).
OPTIMIZER_KEY = "hf_gpa_optimizer"


def require_torchft(user: str = "hf_gpa.optim.diloco.torchft_sync") -> Any:
    """The torchft module, imported now; without it an ImportError naming ``pip install "hf_gpa[torchft]"``."""
    try:
        import torchft
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "torchft":
            raise  # a module torchft needs: a broken install, not ours to explain
        # In hf_gpa.extras' words (hf_gpa.optim imports nothing of hf_gpa outside itself).
        raise ImportError(f'{user} needs torchft, which is not installed: pip install "hf_gpa[torchft]"') from error
    return torchft


def replica_group_id(index: int, num_groups: int) -> str:
    """The replica id of group ``index`` (0-based) of ``num_groups``: its number zero-padded to the width of the
    largest ('0'..'9' for 10 groups, '00'..'11' for 12). torchft ranks the groups of a quorum by their ids as
    strings, so padded ids rank them by number ("10" < "2" otherwise), and the all-reduce adds in the order of a
    torch.distributed run of the same groups."""
    for name, value in (("num_groups", num_groups), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= 0)")
    if index >= num_groups:
        raise ValueError(f"Invalid index: {index!r} (must lie in [0, {num_groups - 1}] for {num_groups} groups)")
    return f"{index:0{len(str(num_groups - 1))}d}"


def _check_seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number of seconds > 0)")
    return float(value)


def _check_count(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {low})")
    return value


def _check_lighthouse(lighthouse: Any) -> str:
    scheme, _, rest = lighthouse.partition("://") if isinstance(lighthouse, str) else ("", "", "")
    if scheme not in ("http", "https") or ":" not in rest:
        raise ValueError(
            f"Invalid lighthouse: {lighthouse!r} (must be the lighthouse's address, http://HOST:PORT, as "
            "torchft_lighthouse --bind serves it; its default port is 29510)"
        )
    return lighthouse


def _check_replica_group(replica_group: Any) -> str:
    if not isinstance(replica_group, str) or not replica_group.isdigit() or not replica_group.isascii():
        raise ValueError(
            f"Invalid replica_group: {replica_group!r} (must be the group's number in decimal digits, zero-padded to "
            "the same width on every group, e.g. '00'..'11' for 12 groups: replica_group_id(index, num_groups))"
        )
    return replica_group


@dataclasses.dataclass
class SyncRecord:
    """One outer sync of this group, as it went: where it was (the Manager's step before it, the inner step after
    it), whether it was the join, its attempts, the seconds of each phase summed over them, the groups it averaged
    (M), whether this group healed in it, and the error of each failed attempt."""

    manager_step: int
    joining: bool
    inner_step: int = -1
    attempts: int = 0
    quorum_s: float = 0.0
    allreduce_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    workers: int = 0
    healed: bool = False
    errors: list[str] = dataclasses.field(default_factory=list)
    #: Wall-clock time (time.time()) at its end, to put the syncs of several processes on one axis.
    ended: float = 0.0


def _group_store(host: str | None, timeout: datetime.timedelta) -> tuple[Any, str, int]:
    """The replica group's TCPStore: torchrun's (``MASTER_ADDR``/``MASTER_PORT``; None: not ours to keep), else one
    started here on a free port of ``host`` (default: this machine's name); (the store, its host, its port)."""
    from torch.distributed import TCPStore

    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # torchrun's store
        return None, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store_host = host or socket.gethostname()
    store = TCPStore(host_name=store_host, port=0, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, store_host, store.port


class TorchftSync(OuterSync):
    """The outer sync of one replica group over a ``torchft.Manager`` (see the module docstring).

    Build it with `connect` (or around a Manager of your own, ``use_async_quorum=True``, ``init_sync=True``, one
    process per group), give it to the optimizer (``DiLoCo(..., sync=sync)``), register what else must heal
    (`heal_also`), then `join` once before training. ``records`` holds one `SyncRecord` per outer sync.

    Args:
        manager: the group's ``torchft.Manager``.
        lighthouse: the lighthouse's address (named by the errors).
        replica_group: this group's replica id (named by the errors).
        max_retries: how many times a sync whose commit failed is sent again (default: 3).
        store: the group's ``TCPStore`` where this sync started it (kept alive with it; default: None).
    """

    not_yet = rules.TORCHFT_NOT_YET

    def __init__(
        self,
        manager: Any,
        *,
        lighthouse: str,
        replica_group: str,
        max_retries: int = DEFAULT_MAX_RETRIES,
        store: Any = None,
    ) -> None:
        super().__init__(WorkerLayout())
        self.max_retries = _check_count(max_retries, "max_retries", 0)
        self.manager = manager
        self.lighthouse = lighthouse
        self.replica_group = replica_group
        self.optimizer: Any = None
        self.records: list[SyncRecord] = []
        self.joined = False
        self._store = store
        self._heals: list[str] = []
        self._joining = False
        self._healed = False
        self._workers = 1

    @classmethod
    def connect(
        cls,
        lighthouse: str,
        replica_group: str,
        *,
        min_replicas: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        quorum_timeout_s: float = DEFAULT_QUORUM_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        host: str | None = None,
    ) -> TorchftSync:
        """This replica group's Manager, connected to the lighthouse at ``lighthouse`` (``http://HOST:PORT``), and
        the sync over it. Every argument is checked before anything starts.

        The group's TCPStore (`_group_store`) is torchrun's or one started here on a free port of ``host``; the other
        groups reach it for the all-reduce's rendezvous. ``min_replicas``: the fewest groups a sync may
        average (torchft's ``min_replica_size``; the lighthouse's ``--min_replicas`` should say the same). A lighthouse
        that cannot be reached within ``connect_timeout_s`` raises a ``ConnectionError`` naming its address; the
        environment variables ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC`` and
        ``TORCHFT_CONNECT_TIMEOUT_SEC`` override the timeouts (torchft reads them).
        """
        lighthouse = _check_lighthouse(lighthouse)
        replica_group = _check_replica_group(replica_group)
        min_replicas = _check_count(min_replicas, "min_replicas", 1)
        timeout = datetime.timedelta(seconds=_check_seconds(timeout_s, "timeout_s"))
        quorum_timeout = datetime.timedelta(seconds=_check_seconds(quorum_timeout_s, "quorum_timeout_s"))
        connect_timeout = datetime.timedelta(seconds=_check_seconds(connect_timeout_s, "connect_timeout_s"))
        _check_count(max_retries, "max_retries", 0)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size != 1:
            raise ValueError(f"Invalid WORLD_SIZE: {world_size} ({rules.TORCHFT_NOT_YET['distributed']})")
        torchft = require_torchft()
        store, store_host, store_port = _group_store(host, timeout)
        try:
            manager = torchft.Manager(
                pg=torchft.ProcessGroupGloo(timeout=timeout),
                load_state_dict=None,
                state_dict=None,
                min_replica_size=min_replicas,
                use_async_quorum=True,  # a group that heals sends zeros and is not counted (the count is ours)
                timeout=timeout,
                quorum_timeout=quorum_timeout,
                connect_timeout=connect_timeout,
                rank=0,
                world_size=1,
                store_addr=store_host,
                store_port=store_port,
                lighthouse_addr=lighthouse,
                replica_id=replica_group,
                init_sync=True,  # at a fresh start, every group but the first heals from it: the broadcast
                max_retries=None,  # ours: max_retries
            )
        except RuntimeError as error:
            raise ConnectionError(
                f"Replica group {replica_group} could not reach the torchft lighthouse at {lighthouse} within "
                f"connect_timeout_s = {connect_timeout.total_seconds():g} s: is torchft_lighthouse running there, and "
                f"is the address right and reachable from this machine? ({error})"
            ) from error
        return cls(manager, lighthouse=lighthouse, replica_group=replica_group, max_retries=max_retries, store=store)

    # ---- what a group serves, and heals from ----

    def attach(self, optimizer: Any) -> None:
        """Serve ``optimizer``'s state to a group that heals from this one, and heal it from a live group when this
        one (re)joins (`checkpoint.served_state`, `checkpoint.heal_from_`). Called by the optimizer built with
        ``sync=`` this sync."""
        if self.optimizer is not None:
            raise ValueError(
                "Invalid sync: this TorchftSync serves another optimizer already (a sync is one replica group's "
                "outer sync of one optimizer; build another with TorchftSync.connect)"
            )
        self.optimizer = optimizer
        self._register(OPTIMIZER_KEY, self._heal, lambda: checkpoint.served_state(optimizer))

    def _heal(self, served: dict[str, Any]) -> None:
        checkpoint.heal_from_(self.optimizer, served)
        self._healed = True

    def heal_also(self, name: str, obj: Any) -> None:
        """Heal ``obj`` (anything with ``state_dict()`` and ``load_state_dict()``: the lr scheduler, a data loader's
        position, the script's counters) with the optimizer when this group (re)joins, and serve it with the
        optimizer's state to a group that heals from this one (copied, so that this group may go on meanwhile).
        Before `join`, on every group alike."""
        if self.joined:
            raise RuntimeError(
                f"TorchftSync.heal_also({name!r}) after join(): what a (re)joining group heals is registered before "
                "it joins, on every group alike"
            )
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ValueError(f"Invalid obj: {type(obj).__name__} has no state_dict() and load_state_dict()")
        self._register(name, obj.load_state_dict, lambda: checkpoint.cpu_copy(obj.state_dict()))

    def _register(self, name: str, load: Any, save: Any) -> None:
        if name in self._heals:
            raise ValueError(f"Invalid name: {name!r} is registered already (one name per healed object)")
        self.manager.register_state_dict_fn(name, load, save)
        self._heals.append(name)

    # ---- joining, and the syncs ----

    @torch.no_grad()
    def join(self) -> None:
        """Take part in the next outer sync of the replica groups with nothing of this group's own (see the module
        docstring): at a fresh start every group starts from the first group's weights; a group that starts late or
        restarts heals from a live one and takes its peers' outer step with them. Once per run, after the optimizer
        and everything registered with `heal_also` are built, before the first step; it waits for the quorum (a late
        group: for its peers' next outer sync) at most the quorum timeout.

        A join that ends at an inner step > 0 stands for the end of the peers' ``optimizer.step()``: what the training
        loop does after ``optimizer.step()`` (the lr scheduler's step) follows it once, as it follows theirs."""
        if self.optimizer is None:
            raise RuntimeError(
                "TorchftSync.join(): no optimizer uses this sync yet; build DiLoCo(..., sync=sync) or "
                "GPADiLoCo(..., sync=sync) first"
            )
        if self.joined:
            raise RuntimeError("TorchftSync.join(): this group has joined already (once per run)")
        optimizer = self.optimizer
        optimizer.init_state()  # every trainable parameter's state: the join sends what the peers' syncs send
        due = [(g, p) for g in optimizer.param_groups for p in g["params"] if OUTER in optimizer.state.get(p, ())]
        self._joining = True
        try:
            optimizer._outer_syncs(due, every=False)
        finally:
            self._joining = False
        self.joined = True

    @property
    def num_workers(self) -> int:
        """M of the last outer sync that averaged anything: the replica groups that did its period (1 before)."""
        return self._workers

    def start(self, due: Due, references: list[torch.Tensor], inners: list[torch.Tensor], states: list[Any]) -> None:
        """One outer sync of the ``due`` parameters (see the module docstring): done when it returns, its average
        pending for the algorithm's outer step; the join and the start of a run (M = 0) leave nothing pending."""
        if not (self.joined or self._joining):
            raise RuntimeError(
                f"TorchftSync (replica group {self.replica_group}): an outer sync before join(). Call sync.join() "
                "once the optimizer and the lr scheduler are built, before the first step, so that the group starts "
                "from its peers' weights"
            )
        with torch.no_grad():
            self._sync(due, references, inners)

    def _sync(self, due: Due, references: list[torch.Tensor], inners: list[torch.Tensor]) -> None:
        manager = self.manager
        record = SyncRecord(manager_step=manager.current_step(), joining=self._joining)
        started = time.perf_counter()
        self._healed = False
        buckets = flat_buckets(references)
        count = torch.zeros(1)  # the groups that send their pseudo-gradients (float32 sums of 0 and 1: exact)
        for attempt in range(1, self.max_retries + 2):
            record.attempts = attempt
            if self._attempt(record, buckets, references, inners, count):
                break
            error = manager.errored()
            record.errors.append(repr(getattr(error, "original_exception", error)))
            logger.warning(
                "Replica group %s: outer sync at manager step %d not committed (attempt %d of %d): %s; taking a new "
                "quorum and sending it again",
                self.replica_group, record.manager_step, attempt, self.max_retries + 1, record.errors[-1],
            )  # fmt: skip
        else:
            raise RuntimeError(
                f"TorchftSync (replica group {self.replica_group}): the outer sync at manager step "
                f"{record.manager_step} was not committed in {self.max_retries + 1} attempts (max_retries = "
                f"{self.max_retries}); the errors: {'; '.join(record.errors)}"
            )
        record.workers, record.healed = round(float(count.item())), self._healed
        record.inner_step = due[0][0][INNER_STEP] if due else -1
        if self._healed:
            logger.info(
                "Replica group %s healed from a live group at manager step %d: inner step %d",
                self.replica_group, manager.current_step(), record.inner_step,
            )  # fmt: skip
        if record.workers:
            self._average(due, record, buckets, references)
        record.total_s = time.perf_counter() - started
        record.ended = time.time()
        self.records.append(record)

    def _attempt(
        self, record: SyncRecord, buckets: list, references: list[torch.Tensor], inners: list[torch.Tensor], count
    ) -> bool:
        """One try of the sync: a quorum, this group's pseudo-gradients (zeros from a group that joins or has just
        healed) and its count summed over the groups, then torchft's commit vote; whether it committed."""
        from torch.distributed import ReduceOp

        manager = self.manager
        t0 = time.perf_counter()
        self._quorum(manager)
        t1 = time.perf_counter()
        sends = not (self._joining or self._healed)  # a healed group's inner weights are its source's
        for flat, idx, views in buckets:
            if sends:
                for i, view in zip(idx, views):
                    torch.sub(references[i], inners[i], out=view)
            else:
                flat.zero_()
        count.fill_(1.0 if sends else 0.0)
        works = [manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in (*(b[0] for b in buckets), count)]
        for work in works:
            work.wait()  # an error is not raised here: torchft reports it to should_commit
        t2 = time.perf_counter()
        committed = manager.should_commit()  # applies a heal first (this group's _heal)
        t3 = time.perf_counter()
        record.quorum_s += t1 - t0
        record.allreduce_s += t2 - t1
        record.commit_s += t3 - t2
        return committed

    def _average(self, due: Due, record: SyncRecord, buckets: list, references: list[torch.Tensor]) -> None:
        """The summed pseudo-gradients divided by the groups that sent them, pending for the outer step; the bytes
        counted."""
        workers = record.workers
        if workers < self._workers:
            logger.warning(
                "Replica group %s: outer sync at manager step %d averaged %d groups (the last one %d)",
                self.replica_group, record.manager_step, workers, self._workers,
            )  # fmt: skip
        self._workers = workers
        averaged = list(references)
        for flat, idx, views in buckets:
            flat.div_(workers)
            for i, view in zip(idx, views):
                averaged[i] = view
            self.traffic.outer_bytes += outer_sent_bytes(flat.numel(), flat.element_size(), "float32", workers)
        self.traffic.outer_steps += 1
        self.pending.append(PendingSync(due, averaged, 0))

    def _quorum(self, manager: Any) -> None:
        """This sync's quorum, waited for; a lighthouse that gives none within the quorum timeout is named."""
        manager.start_quorum()
        try:
            manager.wait_quorum()
        except (TimeoutError, RuntimeError, ConnectionError) as error:
            waited = getattr(manager, "_quorum_timeout", None)  # torchft's, after its environment overrides
            within = f"within the quorum timeout of {waited.total_seconds():g} s" if waited else "within its timeout"
            raise TimeoutError(
                f"TorchftSync (replica group {self.replica_group}): no quorum from the torchft lighthouse at "
                f"{self.lighthouse} {within}, at manager step "
                f"{manager.current_step()}: is the lighthouse running and reachable, are at least min_replicas "
                f"groups up, and is the peers' next outer sync nearer than the timeout? ({error})"
            ) from error

    def close(self) -> None:
        """Stop this group's Manager (its heartbeats, its server of heals) and its store."""
        self.manager.shutdown(wait=False)
        self._store = None

    def __enter__(self) -> TorchftSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "A DiLoCo on torchft (TorchftSync) cannot be copied or pickled: its Manager belongs to this run. Save "
            "optimizer.state_dict() (and the model) instead"
        )
