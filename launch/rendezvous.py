"""How this node meets the others: torchrun's c10d dynamic rendezvous with the settings torchrun would
use for the launcher's options, and the worker spec that runs `python -m trainer` under it. The
rendezvous store listens on the endpoint's address only (torch's own would listen on every interface).

`--rdzv-endpoint` may be an ordered list, `HOST:PORT,HOST:PORT,...`: the store lives in the launcher of
the node at the current endpoint, so when that node is lost the other launchers move down the list to
the next one, whose node hosts a fresh store, and the group restarts there (`launch.supervisor`). A
launcher that starts while the job runs (a replacement node) asks the later endpoints first
(`first_answering`): the job may have moved on already."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from common import net
from common.errors import exception_chain
from common.timing import OWNER_WAIT_S, PROBE_S
from launch.zygote import STUB_PATH
from trainer.contract import COORD_STORE_ENV, is_loopback, tcp_store_server

if TYPE_CHECKING:
    from launch.options import LaunchOptions

DEFAULT_PORT = 29400  # torchrun's
OWNER_KEY = "rekindle/job"  # the rendezvous id of the job whose launcher hosts the store
STANDALONE_ENDPOINT = "127.0.0.1:0"  # this node alone: any free loopback port


def settings(min_nodes: int, max_nodes: int, extra: dict[str, str]) -> dict[str, str]:
    """The c10d rendezvous settings: short keep-alives, so a lost node is noticed within seconds;
    `extra` (--rdzv-conf) overrides them."""
    conf = {"join_timeout": "900", "close_timeout": "10", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
    if min_nodes != max_nodes:
        conf["last_call_timeout"] = "3"  # torchrun waits 30s for late nodes by default
    return {**conf, **extra}


def run_id(name: str, directory: str, standalone: bool) -> str:
    """The rendezvous id when none is given: the nodes of one job (same run.name and run.dir) share
    it; a standalone run gets a fresh one, so that it never meets a previous run's leftovers."""
    salt = os.urandom(4).hex() if standalone else ""
    return "rekindle-" + hashlib.sha256(f"{name}:{directory}:{salt}".encode()).hexdigest()[:12]


def endpoints(value: str) -> list[str]:
    """--rdzv-endpoint's list, in the order the nodes move down it (empty: this node alone)."""
    return [e.strip() for e in value.split(",") if e.strip()]


def listening(endpoint: str, timeout_s: float) -> bool:
    """Whether something accepts connections at rendezvous `endpoint` (HOST[:PORT]) within `timeout_s`
    (a store hosted there): common.net.listening."""
    return net.listening(*parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT), timeout_s)


def first_answering(listed: list[str], timeout_s: float = PROBE_S) -> int:
    """Where a starting launcher meets the others: the first of the later endpoints where a store listens
    (the job moved down the list after losing a node, and this launcher replaces it), else the first
    endpoint (the job's first start). A single endpoint is never asked."""
    return next((i for i, endpoint in enumerate(listed[1:], start=1) if listening(endpoint, timeout_s)), 0)


def worker_spec(opts: LaunchOptions, run_name: str, run_dir: str, max_restarts: int, warm: bool = False,
                endpoint: str = "") -> tuple[WorkerSpec, bool]:
    """torchrun's worker spec for `python -m trainer CONFIG OVERRIDES` on this node, with its rendezvous
    at `endpoint` (one of --rdzv-endpoint; "": this node alone), and whether this node hosts that
    rendezvous's store. `warm`: each rank starts as launch/stub.py, which has the launcher's fork server
    (launch.zygote) fork the trainer (or runs the plain one when it cannot)."""
    standalone = not endpoint
    endpoint = endpoint or STANDALONE_ENDPOINT
    host, _ = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    local_addr = opts.local_addr or ("127.0.0.1" if is_loopback(host) else None)
    params = RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id=opts.rdzv_id or run_id(run_name, run_dir, standalone),
        min_nodes=opts.min_nodes, max_nodes=opts.max_nodes, local_addr=local_addr,
        **settings(opts.min_nodes, opts.max_nodes, opts.rdzv_conf))
    # A restarted group must not reuse the agent's store: its ranks would find the old group's stale gloo addresses.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # -S: the stub needs the standard library only (no site packages to scan: a few hundredths of a second).
    command = ("-S", STUB_PATH) if warm else ("-u", "-m", "trainer")
    rdzv, hosted = handler(params)
    return WorkerSpec(role="trainer", local_world_size=opts.nproc_per_node, entrypoint=sys.executable,
                      args=(*command, opts.config_path, *opts.overrides), rdzv_handler=rdzv,
                      max_restarts=max_restarts, monitor_interval=opts.monitor_interval_s,
                      local_addr=local_addr), hosted


def store_lost(error: BaseException) -> bool:
    """Whether `error` (from the agent) means the rendezvous store stopped answering: the node hosting the
    endpoint is gone, and this node cannot go on without it."""
    from torch.distributed import DistNetworkError

    return any(isinstance(link, (RendezvousConnectionError, DistNetworkError)) for link in exception_chain(error))


def handler(params: RendezvousParameters) -> tuple[RendezvousHandler, bool]:
    """torchrun's c10d rendezvous, and whether this node hosts its store. The store is hosted by the
    first launcher to bind the endpoint's address on the machine that address belongs to, and listens on
    that address only (torch's own would listen on every interface); the others connect to it. torch's
    own choice of host compares the address with the host name's, which fails for a node in a network
    namespace or with several interfaces: binding decides here."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = timedelta(seconds=int(params.get("read_timeout", "60")))
    address, store = local_address(host), None
    if address is not None:
        try:
            store = tcp_store_server(address, port, None, timeout, multi_tenant=True)
        except OSError as e:  # taken: another launcher on this machine hosts the rendezvous, or not a store
            if not listening(params.endpoint, PROBE_S):  # a connection's own port, say: would retry for 60 s
                raise RendezvousConnectionError(f"the rendezvous endpoint {params.endpoint}: port {port} is taken "
                                                f"here, and not by a listening store ({e.strerror})") from e
    hosted = store is not None
    if store is None:
        store = TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    claim_or_check(store, params.run_id, hosted, params.endpoint)
    os.environ[COORD_STORE_ENV] = f"{host}:{store.port}"  # the ranks' store for in-process recovery
    return dynamic_rendezvous.create_handler(store, C10dRendezvousBackend(store, params.run_id), params), hosted


class AnotherJobsStore(RuntimeError):
    """The store at the rendezvous endpoint is hosted by a launcher of another job: this job would live
    and die with that one."""


def claim_or_check(store, job: str, hosted: bool, endpoint: str, wait_s: float = OWNER_WAIT_S) -> None:
    """One job per store: the launcher hosting it writes its job's rendezvous id under `OWNER_KEY`; a launcher
    that connects reads it (waiting up to `wait_s` for a host that has just bound the port) and raises
    AnotherJobsStore when it names another job. A store without the key (not a rekindle launcher's) is
    used as it is."""
    if hosted:
        store.set(OWNER_KEY, job)
        return
    try:
        store.wait([OWNER_KEY], timedelta(seconds=wait_s))
        owner = store.get(OWNER_KEY).decode()
    except Exception:  # noqa: BLE001 - no owner written within wait_s: not a rekindle launcher's store
        return
    if owner != job:
        raise AnotherJobsStore(
            f"the rendezvous store at {endpoint} is hosted by a launcher of another job (rendezvous id "
            f"{owner!r}; this one is {job!r}): it would end when that job does. Give each job an endpoint of "
            f"its own (another port), or the same --rdzv-id if they are one job")


def local_address(host: str) -> str | None:
    """What to listen on when `host` is this machine (its address can be bound here), else None: an IP
    address or a loopback name, that address alone; another name, every interface (as torch), since
    the other nodes may reach it by another address than this machine's resolver gives (Debian maps
    its own host name to 127.0.1.1)."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket() as s:
            s.bind((address, 0))
    except OSError:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return address if is_loopback(host) else ""
    return address
