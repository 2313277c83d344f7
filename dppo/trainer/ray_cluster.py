"""Connecting to Ray predictably.

- No ray.address and no RAY_ADDRESS: always a new local cluster (address="local"), never a stray one that
  some `ray start` left on the machine.
- ray.address=auto: the cluster `ray start` started on this machine; host:port: that cluster.
- A cluster that cannot be reached is one RayConnectError naming the address, within about 20 s where Ray
  alone would retry for minutes: the address is first probed for a server answering the HTTP/2 handshake (as
  Ray's GCS, a gRPC server, does), which settles refused and silent addresses at once; then ray.init runs
  with its first connection bounded (one attempt, RAY_py_gcs_connect_timeout_s=10), unless the environment
  sets those knobs itself. Later reconnects of a running job keep Ray's defaults.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

import ray
from ray._private import ray_constants, services, utils

PROBE_TIMEOUT_S = 5.0
# The client preface of HTTP/2 (RFC 9113, 3.4) and an empty SETTINGS frame; a gRPC server answers with its own
# SETTINGS frame (a 9-byte frame header of type 0x4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_AUTH_HINT = ("If the cluster uses Ray's token authentication (on by default in recent Ray versions: 2.59 for "
              "local clusters, 2.61 for all), run with RAY_AUTH_MODE=token and the cluster's token in "
              "~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")  # fmt: skip


class RayConnectError(ConnectionError):
    """The Ray cluster named by ray.address or RAY_ADDRESS could not be reached or refused this process."""


def cluster_address(cfg) -> str:
    """What ray.init is given: ray.address, else RAY_ADDRESS, else "local" (a new local cluster)."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or "local"


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
        raise RayConnectError(f"could not join the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): "
                              f"{shown}: {reason.lower()} within {timeout_s:g} s") from None  # fmt: skip
    if len(head) < 9 or head[3] != 0x4:
        raise RayConnectError(f"could not join the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): "
                              f"{shown} answers, but not as a Ray cluster (no gRPC server there)")  # fmt: skip


# Ray's knobs for the first connection to a GCS (each bounds one phase of ray.init's connect).
_FIRST_CONNECT_ENV = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_py_gcs_connect_timeout_s": "10",
                      "RAY_gcs_rpc_server_connect_timeout_s": "5"}  # fmt: skip


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


def probe_cluster(cfg) -> None:
    """probe() the cluster cfg names, unless this process is connected to one already."""
    if not ray.is_initialized():
        probe(cluster_address(cfg))


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
    for module, name, value in ((utils, "set_sigterm_handler", lambda handler: None),
                                (ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", True)):  # fmt: skip
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


def init_ray(cfg) -> bool:
    """Connect as the module docstring says (quietly); nothing if this process is already connected. True if
    this call connected (then the caller owns the connection and shuts it down). RayConnectError, naming the
    address, if a given cluster cannot be joined."""
    if ray.is_initialized():
        return False
    address = cluster_address(cfg)
    probe(address)
    kwargs = dict(address=address, include_dashboard=False, log_to_driver=True, logging_level="WARNING",
                  configure_logging=True)  # fmt: skip
    if address == "local" and cfg.ray.num_cpus is not None:
        kwargs["num_cpus"] = cfg.ray.num_cpus
    # Workers must import dppo from the same tree as the driver, also when it is not installed.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1",
                                          "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(cfg.rollout.num_threads)}}  # fmt: skip
    try:
        with _caller_signal_handlers(), (_bounded_first_connect() if address != "local" else contextlib.nullcontext()):
            ray.init(**kwargs)
    except ConnectionError as err:  # ray raises ConnectionError (or a subclass) once its retries are spent
        if address == "local":
            raise
        raise RayConnectError(f"could not join the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): "
                              f"{' '.join(str(err).split())}. {_AUTH_HINT}") from None  # fmt: skip
    return True


def cluster_cpus() -> float:
    """CPUs of the Ray cluster this process is connected to."""
    return float(ray.cluster_resources().get("CPU", 0.0))
