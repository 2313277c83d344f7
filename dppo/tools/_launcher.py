"""The sandbox's first stage: a script, run as `python -I -S _launcher.py CONFIG_JSON` in a session of its own, that
sets up the kernel's limits and (in mode "kernel") namespaces, then starts the second stage (_guard.py's source, the
Python guard that runs the model's code). Stdlib only: it imports nothing of dppo and runs before any of the model's
code, with the privileges of the process that started it.

Mode "kernel" (dppo.tools.sandbox falls back to "rlimits" when the kernel refuses it):
  1. new namespaces: mount, network, PID, IPC, UTS; as a user other than root also a user namespace, in which this
     process's own uid and gid are mapped to 1000 (that needs no privilege);
  2. a new root: a tmpfs holding read-only binds of the system's library folders and of the Python installation
     (config["binds"]), /dev/null, /dev/zero, /dev/random and /dev/urandom, and at the working directory's path a
     tmpfs of its own of config["disk_bytes"]; the old root is moved away (MS_MOVE onto "/" and chroot);
  3. a fork: the child, PID 1 of the new PID namespace, is its init. This process writes "init:<its pid>" to
     config["status_fd"]; the init takes a process group of its own (the parent kills that group, not this
     process, so that this process ends only after the init, which the kernel lets end only after every other
     process of its namespace: when the parent sees this process end, nothing of the run is left). The init gets
     SIGKILL when this process dies (PR_SET_PDEATHSIG), becomes an unprivileged user (root: a uid of its own,
     0x70000000 + this process's pid, so that RLIMIT_NPROC, which root ignores, counts this run's processes alone;
     otherwise uid 1000 of the user namespace, whose processes RLIMIT_NPROC counts apart from the user's others),
     sets no_new_privs, and forks the program, which sets the rlimits and executes the second stage. The init
     reaps every process until the program ended, writes "status:<wait status>" to config["status_fd"] and
     exits: the kernel then kills every process left in the namespace, even one that left the process group. The
     program is not PID 1 itself because the kernel ignores signals a namespace's init has no handler for:
     SIGXCPU would never stop it.
Mode "rlimits": the rlimits, root becomes a uid of its own as above (where config["own_uid"] says that uid can
start the interpreter), and the second stage replaces this process (its exit status is the program's).

A step that fails before the second stage starts writes "setup:<message>" to config["status_fd"] and exits with
EXIT_SETUP: nothing of the model's code has run then. The program's copy of that descriptor is closed by its execve,
so the model's code cannot write a false status. Each message is one line.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

EXIT_SETUP = 119
OWN_UID_BASE = 0x70000000  # far above the uids of real accounts; + a pid, which no other live launcher has
INNER_ID = 1000  # the uid and gid the user namespace maps the caller to (not 0: execve then drops its capabilities)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 0x20, 0x400, 0x800, 0x1000, 0x2000, 0x4000
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(OSError):
    """A step of the setup failed; the message names it."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise SetupError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    _check(_libc.mount(*args, flags, None if data is None else data.encode()), f"mount {source} on {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enter_namespaces() -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if os.geteuid() == 0:
        _check(_libc.unshare(flags), "unshare (as root)")
        return
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare with a user namespace")
    _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
    _write("/proc/self/uid_map", f"{INNER_ID} {uid} 1")
    _write("/proc/self/gid_map", f"{INNER_ID} {gid} 1")


def _locked_flags(path: str) -> int:
    """The mount flags of path's mount that a remount inside a user namespace must keep (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    pairs = [(os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME)]
    pairs += [(os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)]
    return sum(ms for st, ms in pairs if f & st)


def _bind(root: str, path: str, read_only: bool) -> None:
    """path, seen at the same place under root; a symlink (/lib -> usr/lib) is copied as a symlink."""
    target = root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | _locked_flags(path))


def _new_root(config: dict, owner: int | None) -> None:
    """Steps 2 of mode "kernel": the tmpfs root with its binds and the working directory's own tmpfs, entered."""
    root, work = config["root"], config["work"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here shows outside
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in config["binds"]:
        if os.path.lexists(path):
            _bind(root, path, read_only=True)
    for path in DEVICES:
        if os.path.exists(path):
            _bind(root, path, read_only=False)
    os.makedirs(root + work)
    # noexec: a program or a shared library the code writes there cannot be executed or loaded (mmap PROT_EXEC)
    _mount("tmpfs", root + work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={config['disk_bytes']},mode=700")
    if owner is not None:
        os.chown(root + work, owner, owner)
    os.chdir(root)
    _mount(".", "/", None, MS_MOVE)
    os.chroot(".")


def _set_limits(config: dict, own_processes: int) -> None:
    """The program's rlimits; own_processes: the sandbox's processes that RLIMIT_NPROC counts beside the code's."""
    cpu_s, nproc = config["cpu_time_s"], config["processes"] + own_processes
    limits = [
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
        (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_size_bytes"], config["file_size_bytes"]),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _become_unprivileged(owner: int | None) -> None:
    if owner is not None:
        os.setgroups([])
        os.setresgid(owner, owner, owner)
        os.setresuid(owner, owner, owner)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _exec_guard(config: dict, guard_source: str, code_fd: int) -> None:
    os.chdir(config["work"])
    env = dict(config["env"], HOME=config["work"], TMPDIR=config["work"])
    argv = [config["python"], "-I", "-B", "-u"]
    if config["python_guard"]:
        # compiled under a name of its own, so that its frames can be told from the code's own exec("...") ones
        stub = "import sys\nexec(compile(sys.argv[1], '<sandbox>', 'exec'))"
        argv += ["-c", stub, guard_source, str(code_fd), config["work"]]
    else:  # the kernel's layers alone (tests of those): the code as it is
        with os.fdopen(code_fd) as f:
            argv += ["-c", f.read()]
    os.execve(config["python"], argv, env)


def _code_fd(config: dict) -> int:
    """The model's code, open for the second stage to read (its file is outside the working directory)."""
    fd = os.open(config["code"], os.O_RDONLY)
    os.set_inheritable(fd, True)
    return fd


def _init(config: dict, guard_source: str, code_fd: int, owner: int | None, alive_r: int) -> None:
    """PID 1 of the new PID namespace (step 3 of mode "kernel"); never returns."""
    os.setpgid(0, 0)
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    os.set_blocking(alive_r, False)
    try:
        if os.read(alive_r, 1) == b"":  # the launcher died before the prctl: nobody would kill this init
            raise SetupError(0, "the launcher died during the setup")
    except BlockingIOError:
        pass  # still alive
    os.close(alive_r)
    _become_unprivileged(owner)
    program = os.fork()
    if program == 0:
        # RLIMIT_NPROC also counts this init, and in a user namespace the launcher
        _set_limits(config, own_processes=1 if owner is not None else 2)
        _exec_guard(config, guard_source, code_fd)
    os.close(code_fd)
    while True:  # reap orphans too, until the program itself ended
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            break
    os.write(config["status_fd"], f"status:{status}\n".encode())
    os._exit(0)


def _kernel_mode(config: dict, guard_source: str) -> None:
    owner = OWN_UID_BASE + os.getpid() if os.geteuid() == 0 else None
    code_fd = _code_fd(config)
    _enter_namespaces()
    _new_root(config, owner)
    alive_r, alive_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(alive_w)
        _init(config, guard_source, code_fd, owner, alive_r)
    os.setpgid(init, init)  # as the init does itself: whichever runs first, the group exists when the parent reads
    os.write(config["status_fd"], f"init:{init}\n".encode())
    os.close(alive_r)
    os.close(code_fd)
    os.close(config["status_fd"])
    os.wait()
    os._exit(0)  # the program's status went to the parent through status_fd


def _rlimits_mode(config: dict, guard_source: str) -> None:
    # As root without config["own_uid"] (the interpreter is out of reach of other uids), the code runs as root:
    # RLIMIT_NPROC does not hold then, the Python guard's refusal of fork and the group's kill are all there is.
    owner = OWN_UID_BASE + os.getpid() if os.geteuid() == 0 and config["own_uid"] else None
    code_fd = _code_fd(config)
    if owner is not None:
        os.chown(config["work"], owner, owner)
    # Another user's RLIMIT_NPROC counts every task (process or thread) of that user, a Ray worker's hundreds
    # included: the code gets `processes` (this process, the code's first, among them) more than that user runs now.
    _set_limits(config, own_processes=0 if owner is not None or os.geteuid() == 0 else _tasks_of(os.getuid()) - 1)
    _become_unprivileged(owner)
    _exec_guard(config, guard_source, code_fd)


def _tasks_of(uid: int) -> int:
    """Tasks (processes and threads) whose real uid is uid, as RLIMIT_NPROC counts them (this process included)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
            real_uid = int(status.split("\nUid:", 1)[1].split()[0])
            threads = int(status.split("\nThreads:", 1)[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if real_uid == uid:
            count += threads
    return count


def main() -> None:
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)  # closed by the execve of the second stage
    try:
        with open(config["guard"]) as f:
            guard_source = f.read()
        (_kernel_mode if config["mode"] == "kernel" else _rlimits_mode)(config, guard_source)
    except OSError as err:  # the setup's own failures (SetupError, PermissionError, ...) before any model code
        os.write(status_fd, ("setup:" + " ".join(str(err).split()) + "\n").encode(errors="replace"))
        os._exit(EXIT_SETUP)


if __name__ == "__main__":
    main()
