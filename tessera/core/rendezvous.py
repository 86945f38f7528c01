"""Joining a job's rendezvous, where every way it can fail is one line naming the thing to fix.

torch's own rendezvous fails with a ``DistNetworkError`` traceback after the timeout (nothing listening),
an ``EADDRINUSE`` traceback (the port is taken), waits forever on a port another program holds (its
client never times out there), and leaves a missing rank to a gloo timeout naming no variable. Here
the store is made by hand, each step bounded by ``dist.timeout_s``:

- the launch environment is checked first (a rank outside the world size, a backend this machine does
  not have, a host name that does not resolve), on every rank alike and before any connection;
- rank 0 serves the store (or torchrun's agent does, which gathered the ranks already); a port in use
  is named;
- every other rank waits for the port to answer with plain sockets (no retry noise from the C++
  client), then connects in a thread it stops waiting for at the deadline (a foreign program on the
  port never answers);
- the ranks count themselves in the store: a rank that never came and a rank started twice are named
  with the variable that sets the world size or the rank.

Each failure is a ``LaunchError``; the exception it replaces stays chained (``train.py`` logs the
traceback at debug level).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["LaunchError", "Rendezvous", "check_backend", "check_rank", "wait_for_peers_to_report"]

_POLL_S = 0.1  # how often a waiting rank looks again (the port, the count of ranks)
_KEY = "tessera/launch/"  # the store keys of the rank count
_GRACE_S = 1.0  # how long rank 0 keeps the store up after giving up, for the others to read why


class LaunchError(RuntimeError):
    """A launch that cannot go on; the message is one line naming what to fix (a host, port, variable, backend)."""


def check_backend(backend: str) -> None:
    """``LaunchError`` when the process-group backend cannot run on this machine (NCCL without CUDA or NCCL)."""
    why = None
    if backend == "nccl" and not dist.is_nccl_available():
        why = "this torch is built without NCCL"
    elif backend == "nccl" and not torch.cuda.is_available():
        why = "no CUDA device is visible to this process"
    elif backend == "gloo" and not dist.is_gloo_available():
        why = "this torch is built without gloo"
    if why:
        raise LaunchError(f"backend {backend} (dist.backend) is not available: {why}; use dist.backend='gloo' on "
                          "CPUs, or leave dist.backend unset (nccl where CUDA is, else gloo)")


def check_rank(rank: int, world_size: int, rank_name: str, world_name: str) -> None:
    """``LaunchError`` when the rank and world size this process was given cannot belong to one job."""
    if world_size < 1:
        raise LaunchError(f"{world_name}={world_size}: a job has at least one process")
    if not 0 <= rank < world_size:
        raise LaunchError(f"{rank_name}={rank} does not fit {world_name}={world_size} (ranks 0..{world_size - 1}): "
                          f"launch every process of the job with the same {world_name} and its own {rank_name}")


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this rank meets the others: ``host:port``, served by rank 0 (or by torchrun's agent)."""

    host: str
    port: int
    rank: int
    world_size: int
    names: tuple[str, str] = ("MASTER_ADDR", "MASTER_PORT")  # how the user sets host and port
    world_name: str = "WORLD_SIZE"  # the variable that sets the world size
    rank_name: str = "RANK"  # the variable that sets the rank
    agent: bool = False  # torchrun's agent serves the store and has gathered the ranks: only connect
    prefix: str = ""  # a key prefix for the store (torchrun's restart attempt)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def connect(self, timeout_s: float) -> dist.Store:
        """The job's store, once every rank has joined it; a ``LaunchError`` within ``timeout_s`` (and a few
        seconds) otherwise."""
        deadline = time.monotonic() + timeout_s
        self._check_address()
        if self.rank == 0 and not self.agent:
            store: dist.Store = self._serve(timeout_s)
        else:
            store = self._client(timeout_s, deadline)
        if self.prefix:
            store = dist.PrefixStore(self.prefix, store)
        if not self.agent:
            try:
                self._count_ranks(store, deadline, timeout_s)
            except dist.DistError as e:  # rank 0 (the store) went away meanwhile
                raise LaunchError(f"rendezvous at {self.where}: lost rank 0's store ({_first_line(e)}); rank 0 "
                                  "stopped, its own output says why") from e
        return store

    def _check_address(self) -> None:
        host_name, port_name = self.names
        if not 0 < self.port < 2**16:
            raise LaunchError(f"{port_name}={self.port} is not a port number (1..65535)")
        try:
            socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise LaunchError(f"{host_name}={self.host} does not resolve ({getattr(e, 'strerror', None) or e}): set "
                              "it to the host name or address of the node that runs rank 0") from e

    def _serve(self, timeout_s: float) -> dist.Store:
        try:
            return dist.TCPStore(self.host, self.port, self.world_size, is_master=True, multi_tenant=True,
                                 timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        except (dist.DistError, RuntimeError) as e:
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                raise LaunchError(f"rendezvous port {self.port} ({self.names[1]}) on {socket.gethostname()} is in "
                                  "use by another program (or by another rank 0 of this job): choose a free port, or "
                                  "stop what holds it") from e
            raise LaunchError(f"cannot serve the rendezvous on port {self.port} ({self.names[1]}) of "
                              f"{socket.gethostname()}: {_first_line(e)}") from e

    def _client(self, timeout_s: float, deadline: float) -> dist.Store:
        self._wait_for_port(timeout_s, deadline)
        box: dict[str, object] = {}

        def connect() -> None:
            try:
                box["store"] = dist.TCPStore(self.host, self.port, self.world_size, is_master=False,
                                             timeout=timedelta(seconds=timeout_s))
            except Exception as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e

        thread = threading.Thread(target=connect, name="tessera-rendezvous", daemon=True)
        thread.start()
        thread.join(max(deadline - time.monotonic(), 0.0) + 2 * _POLL_S)
        if thread.is_alive():
            raise LaunchError(f"rendezvous at {self.where}: something accepts connections there but did not answer "
                              f"as rank 0's store within {timeout_s:g} s (dist.timeout_s): another program may hold "
                              f"port {self.port}; choose another {self.names[1]} for every rank")
        error = box.get("error")
        if isinstance(error, BaseException):
            raise LaunchError(f"rendezvous at {self.where}: cannot connect ({_first_line(error)})") from error
        store = box["store"]
        assert isinstance(store, dist.Store)
        return store

    def _wait_for_port(self, timeout_s: float, deadline: float) -> None:
        """Until ``host:port`` accepts a connection; the C++ client would log every failed try."""
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=max(min(deadline - time.monotonic(),
                                                                                      2.0), _POLL_S)):
                    return
            except OSError as e:
                reason = e.strerror or str(e) or type(e).__name__
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"rendezvous at {self.where} unreachable: no answer in {timeout_s:g} s (dist.timeout_s; last: "
                    f"{reason}): check that rank 0 of this job runs on {self.host} and listens on port {self.port}, "
                    f"that every rank has the same {self.names[0]} and {self.names[1]}, and that no firewall blocks "
                    "the port")
            time.sleep(_POLL_S)

    def _count_ranks(self, store: dist.Store, deadline: float, timeout_s: float) -> None:
        """Every rank adds itself; all wait until ``world_size`` have. Names a rank started twice, or missing.

        Rank 0 holds the store, which goes down with it: when it gives up, it posts its message and waits a
        moment, so the others report the same line instead of a lost connection."""
        if store.add(f"{_KEY}rank_{self.rank}", 1) > 1:
            raise LaunchError(f"rendezvous at {self.where}: a second process joined as rank {self.rank} "
                              f"({self.rank_name}={self.rank}): every process of the job needs its own "
                              f"{self.rank_name}")
        store.add(f"{_KEY}joined", 1)
        while (joined := store.add(f"{_KEY}joined", 0)) < self.world_size:
            if store.check([f"{_KEY}failed"]):
                raise LaunchError(store.get(f"{_KEY}failed").decode())
            if time.monotonic() >= deadline:
                message = (f"rendezvous at {self.where}: {joined} of {self.world_size} ranks joined in {timeout_s:g} "
                           f"s (dist.timeout_s): check that {self.world_name}={self.world_size} is the number of "
                           "processes launched and that each started (one that failed first says why in its own "
                           "output)")
                if self.rank == 0:
                    store.set(f"{_KEY}failed", message)
                    time.sleep(_GRACE_S)
                raise LaunchError(message)
            time.sleep(_POLL_S)


def wait_for_peers_to_report(bound_s: float) -> None:
    """Under torchrun's agent, after this rank reported a failure of its own (before the job was joined): wait, at
    most ``bound_s``, until every rank of this attempt has reported one too.

    torchrun stops every worker at the first one's exit, so ranks that fail alike (a backend this machine lacks, a
    config error) would otherwise print one line on whichever rank is fastest. The count lives in the agent's store,
    under this restart attempt's key; a rank that does not fail never counts, and the wait ends at the bound."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    deadline = time.monotonic() + bound_s
    key = f"tessera/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/failed_reports"
    with contextlib.suppress(Exception):  # only a courtesy to the peers: the error is reported already
        world = int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timedelta(seconds=bound_s))
        store.add(key, 1)
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(_POLL_S)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
