"""Connecting to Ray predictably.

- No ray.address and no RAY_ADDRESS: always a new local cluster (address="local"), never a stray one that
  some `ray start` left on the machine.
- ray.address=auto: the cluster `ray start` started on this machine; host:port: that cluster.
- A cluster that cannot be reached is one RayConnectError naming the address, within about 20 s where Ray
  alone would retry for minutes: the address is first probed for a server answering the HTTP/2 handshake (as
  Ray's GCS, a gRPC server, does), which settles refused and silent addresses at once; then ray.init runs
  with its first connection bounded (one attempt, RAY_py_gcs_connect_timeout_s=10), unless the environment
  sets those knobs itself. Later reconnects of a running job keep Ray's defaults.
- A local cluster this process starts does not outlive it, even SIGKILLed: every process the cluster starts
  carries DPPO_RAY_CLUSTER=<a marker of this cluster> in its environment, and a watchdog process (RAY_WATCHDOG)
  waits on a pipe from this one; when the pipe closes (this process ended, however, or shutdown_ray) it SIGKILLs
  each process with the marker. Ray alone leaves its agents (DashboardAgent, RuntimeEnvAgent, about 90 MB each)
  alive for about a minute after the driver's SIGKILL, trying to tell a dead GCS that their raylet died.
- Ray's own line for each worker death ("(raylet) A worker died or was killed ...", and its out-of-memory summary)
  is left out of what the driver prints: dppo says each death in its own line (restarted, or why the run ends).
- The workers' environment (PYTHONPATH of this tree, HF_HUB_OFFLINE, ...) is a given cluster's job runtime_env; a
  new local cluster inherits it from this process instead, so that its prestarted workers serve the actors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid

import ray
from ray._private import ray_constants, services, utils
from ray._private import worker as ray_worker

PROBE_TIMEOUT_S = 5.0
# The client preface of HTTP/2 (RFC 9113, 3.4) and an empty SETTINGS frame; a gRPC server answers with its own
# SETTINGS frame (a 9-byte frame header of type 0x4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_AUTH_HINT = (
    "If the cluster uses Ray's token authentication (on by default in recent Ray versions: 2.59 for "
    "local clusters, 2.61 for all), run with RAY_AUTH_MODE=token and the cluster's token in "
    "~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN"
)


class RayConnectError(ConnectionError):
    """The Ray cluster named by ray.address or RAY_ADDRESS could not be reached or refused this process."""


def cluster_address(ray_cfg) -> str:
    """What ray.init is given (ray_cfg: the config's ray section): ray.address, else RAY_ADDRESS, else "local" (a new
    local cluster)."""
    return ray_cfg.address or os.environ.get("RAY_ADDRESS") or "local"


def _resolve(address: str) -> tuple[str, int] | None:
    """(host, port) of the GCS that address names, as Ray resolves it; None where there is nothing to probe."""
    if address == "local" or "://" in address:
        return None  # a new local cluster, or a Ray Client address (not a GCS)

    try:
        resolved = services.canonicalize_bootstrap_address_or_die(address)
    except ConnectionError as err:  # "auto" with no cluster on this machine
        raise RayConnectError(f"ray.address={address!r}: {err}") from None
    except ValueError as err:
        raise RayConnectError(f"ray.address={address!r} is not host:port or auto ({err})") from None
    host, _, port = resolved.rpartition(":")
    return host.strip("[]"), int(port)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """RayConnectError unless a gRPC server answers at the GCS address that address resolves to."""
    where = _resolve(address)
    if where is None or os.environ.get("RAY_USE_TLS", "0") not in ("", "0"):
        return  # nothing to probe (with TLS the handshake is not plain HTTP/2)
    host, port = where
    shown = f"{host}:{port}" if f"{host}:{port}" != address else address
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(_HTTP2_PREFACE)
            head = sock.recv(9)
    except OSError as err:
        reason = "no answer" if isinstance(err, TimeoutError) else (err.strerror or type(err).__name__)
        raise RayConnectError(
            f"could not join the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): "
            f"{shown}: {reason.lower()} within {timeout_s:g} s"
        ) from None
    if len(head) < 9 or head[3] != 0x4:
        raise RayConnectError(
            f"could not join the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): "
            f"{shown} answers, but not as a Ray cluster (no gRPC server there)"
        )


# Ray's knobs for the first connection to a GCS (each bounds one phase of ray.init's connect).
_FIRST_CONNECT_ENV = {
    "RAY_gcs_server_port_wait_time_s": "1",
    "RAY_py_gcs_connect_timeout_s": "10",
    "RAY_gcs_rpc_server_connect_timeout_s": "5",
}


@contextlib.contextmanager
def _bounded_first_connect():
    """Within: ray.init gives up on an existing cluster's address in about 20 s (the caller's own settings win)."""
    added = {k: v for k, v in _FIRST_CONNECT_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def _cluster_environment(env_vars: dict[str, str]):
    """Within: this process's environment has env_vars (put back afterwards). A new local cluster's processes inherit
    them from here, its workers included; as a job's runtime_env they would not reach the workers Ray prestarts
    when the cluster starts, which would then idle beside a new process for each actor."""
    saved = {key: os.environ.get(key) for key in env_vars}
    os.environ.update(env_vars)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def probe_cluster(ray_cfg) -> None:
    """probe() the cluster the ray section names, unless this process is connected to one already."""
    if not ray.is_initialized():
        probe(cluster_address(ray_cfg))


@contextlib.contextmanager
def _caller_signal_handlers():
    """Where the caller installed a SIGTERM handler of its own (`dppo train` does), it keeps receiving SIGTERM
    during ray.init and after. ray.init would replace it twice: with a Python handler (sys.exit) as it starts, and
    with Ray's C++ failure-signal handler (a stack dump, then abort) once the driver's core worker exists. The
    first is skipped; the second is not installed in this process (Ray's RAY_DISABLE_FAILURE_SIGNAL_HANDLER, for
    this driver only: the cluster's own processes keep theirs); the caller's handler is put back afterwards."""
    previous = signal.getsignal(signal.SIGTERM) if _in_main_thread() else None
    if not callable(previous):
        yield
        return

    saved = {}
    for module, name, value in (
        (utils, "set_sigterm_handler", lambda handler: None),
        (ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", True),
    ):
        if hasattr(module, name):
            saved[module, name] = getattr(module, name)
            setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        signal.signal(signal.SIGTERM, previous)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def init_ray(ray_cfg, worker_threads: int = 1) -> bool:
    """Connect as the module docstring says (quietly) to the cluster of ray_cfg (the config's ray section), its
    workers' OMP_NUM_THREADS worker_threads (rollout.num_threads); nothing if this process is already connected.
    True if this call connected (then the caller owns the connection and shuts it down). RayConnectError, naming
    the address, if a given cluster cannot be joined."""
    _quiet_ray_death_lines()
    if ray.is_initialized():
        return False
    address = cluster_address(ray_cfg)
    probe(address)
    kwargs = dict(
        address=address, include_dashboard=False, log_to_driver=True, logging_level="WARNING", configure_logging=True
    )
    if address == "local" and ray_cfg.num_cpus is not None:
        kwargs["num_cpus"] = ray_cfg.num_cpus
    # Workers must import dppo from the same tree as the driver, also when it is not installed.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env_vars = {
        "PYTHONPATH": pythonpath,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(worker_threads),
    }
    if address != "local":
        kwargs["runtime_env"] = {"env_vars": env_vars}
    try:
        local_env = _cluster_environment(env_vars) if address == "local" else contextlib.nullcontext()
        with _caller_signal_handlers(), _bounded_first_connect() if address != "local" else _watched(), local_env:
            ray.init(**kwargs)
    except BaseException as err:
        _stop_watchdog()  # what ray.init started of the cluster goes with it
        if address == "local" or not isinstance(err, ConnectionError):  # ray raises ConnectionError (or a
            raise  # subclass) once its retries for a given address are spent
        raise RayConnectError(
            f"could not join the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): "
            f"{' '.join(str(err).split())}. {_AUTH_HINT}"
        ) from None
    return True


def shutdown_ray() -> None:
    """ray.shutdown(), then whatever of a local cluster init_ray started is still running is killed."""
    try:
        ray.shutdown()
    finally:
        _stop_watchdog()


# ---- the watchdog: a local cluster ends with its driver, however the driver ends --------------------------------

CLUSTER_ENV = "DPPO_RAY_CLUSTER"  # the marker every process of a local cluster init_ray started carries
# The watchdog's program (argv[1:3]: CLUSTER_ENV and the marker; its parent is the driver). It ignores SIGINT (a
# Ctrl-C reaches the driver, which stops the cluster itself). Until its stdin, a pipe only the driver writes to,
# closes (the driver ended, or shut the cluster down), it notes every second which processes below the driver
# carry the marker or are below one that does (pid and start time): Ray's agents overwrite their environment with
# their process title, so the marker alone would miss them once the raylet is gone. Then it SIGKILLs those still running and every process whose environment holds the marker, until
# none is left (the raylet may start another worker as the first ones die).
RAY_WATCHDOG = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
driver, me, entry = os.getppid(), os.getpid(), ("\0%s=%s\0" % tuple(sys.argv[1:3])).encode()

def table():
    rows = {}
    for name in os.listdir("/proc"):
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            rows[int(name)] = (int(fields[1]), fields[19], fields[0])  # ppid, start time, state
        except (OSError, ValueError, IndexError):
            pass
    return rows

def marked(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return entry in b"\0" + f.read()
    except OSError:
        return False

def cluster(rows):  # {pid: start time} below the driver, marked or below a marked one
    children = {}
    for pid, (ppid, start, state) in rows.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [(driver, False)]
    while todo:
        parent, inside = todo.pop()
        for pid in children.get(parent, []):
            start = rows[pid][1]
            inside_too = inside or seen.get(pid) == start or marked(pid)
            if inside_too:
                found[pid] = start
            todo.append((pid, inside_too))
    return found

seen = {}
while not select.select([0], [], [], 1.0)[0]:
    seen.update(cluster(table()))
while os.read(0, 4096):
    pass
quiet_rounds, deadline = 0, time.monotonic() + 10.0
while quiet_rounds < 3 and time.monotonic() < deadline:
    found, rows = 0, table()
    for pid, (ppid, start, state) in rows.items():
        if state == "Z" or pid == me:
            continue
        if seen.get(pid) == start or marked(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                found += 1
            except OSError:
                pass
    quiet_rounds = 0 if found else quiet_rounds + 1
    time.sleep(0.1)
"""

_watchdog: dict = {}  # "marker", "pipe" (the write end), "process" while a watchdog runs


@contextlib.contextmanager
def _watched():
    """Within: the local cluster ray.init starts gets a watchdog (Linux; elsewhere nothing). Its marker is in this
    process's environment only meanwhile: the GCS and the raylet inherit it, and the raylet passes it on to every
    agent and worker it starts; what this process starts later does not carry it."""
    if not sys.platform.startswith("linux"):
        yield
        return
    _start_watchdog()
    os.environ[CLUSTER_ENV] = _watchdog["marker"]
    try:
        yield
    finally:
        del os.environ[CLUSTER_ENV]


def _start_watchdog() -> None:
    """A watchdog with a new marker (one a previous cluster's watchdog had is ended first)."""
    _stop_watchdog()
    marker = f"dppo-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    read_fd, write_fd = os.pipe()  # not inheritable: only this process holds the write end
    try:
        env = {k: v for k, v in os.environ.items() if k != CLUSTER_ENV}
        process = subprocess.Popen(
            [sys.executable, "-c", RAY_WATCHDOG, CLUSTER_ENV, marker], stdin=read_fd, env=env, start_new_session=True
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    _watchdog.update(marker=marker, pipe=write_fd, process=process)


def _stop_watchdog() -> None:
    """Close the watchdog's pipe (it kills what is left of the cluster, then ends) and wait for it."""
    if not _watchdog:
        return
    os.close(_watchdog["pipe"])
    try:
        _watchdog["process"].wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    _watchdog.clear()


# ---- Ray's own lines for a worker death -------------------------------------------------------------------------

# What the raylet sends the driver when a worker dies or its memory monitor kills one (Ray 2.x)
_RAY_DEATH_LINES = (
    "A worker died or was killed while executing a task",
    "Workers (tasks / actors) killed due to memory pressure",
)


def _quiet_ray_death_lines() -> None:
    """Leave Ray's lines for a worker death out of what this driver prints (its error listener prints each message
    the raylet sends, "(raylet) ..." on stdout, through ray._private.worker.print_to_stdstream); the rest stays."""
    printer = ray_worker.print_to_stdstream
    if getattr(printer, "dppo_quiet", False):
        return

    def print_to_stdstream(data, ignore_prefix):
        if data.get("pid") == "raylet":
            lines = [line for line in data.get("lines", []) if not any(words in line for words in _RAY_DEATH_LINES)]
            if not lines:
                return
            data = {**data, "lines": lines}
        printer(data, ignore_prefix)

    print_to_stdstream.dppo_quiet = True
    ray_worker.print_to_stdstream = print_to_stdstream


def cluster_cpus() -> float:
    """CPUs of the Ray cluster this process is connected to."""
    return float(ray.cluster_resources().get("CPU", 0.0))
