"""The sandbox's second stage: run as `python -I -B -u -c <stub> <this source> CODE_FD WORKDIR` by _launcher.py (the
stub compiles this source under the name "<sandbox>", which its traceback printing leaves out), inside the
kernel's limits. It reads the model's code from CODE_FD, installs an audit hook (PEP 578) and runs the code as
__main__ with WORKDIR as its working directory. Stdlib only; it imports nothing of dppo.

What the hook refuses (raising Refused, a PermissionError, or RefusedImport, an ImportError, so that a library that
tries an optional import carries on without it):
  - opening a file for writing, and creating, removing, renaming or changing anything, outside WORKDIR;
  - opening for reading, or listing, anything outside WORKDIR and the interpreter's own sys.path folders (stdlib,
    site-packages), except /dev/null, /dev/zero, /dev/random, /dev/urandom; opening a folder outside WORKDIR;
  - links and symlinks; changing the working directory out of WORKDIR; a path of any type but str, bytes or int
    (int: a descriptor already open, refused where it would change something);
  - starting or signalling processes (os.system, exec, spawn, fork, posix_spawn, subprocess, kill);
  - every socket operation (socket.*: creation, connect, bind, name lookups);
  - ctypes (its import and its events), the modules that reach the OS around the audit events (_posixsubprocess,
    _posixshmem, _multiprocessing, _dbm, _gdbm, cffi, the _test* modules, subinterpreters), building code objects
    by hand, changing rlimits, and walking the garbage collector's object graph.

Why the hook is hard to switch off from Python: an audit hook cannot be removed; it is one closure that holds only
immutable values, exception classes and built-in functions captured before the model's code runs (patching os,
posixpath or builtins afterwards changes nothing it uses); it calls no method the model's code could override (a
str subclass is read through "".join); and no reference to it is left where the model's code could reach it (its
factory's frame is gone; gc walks are refused). What it cannot stop, and why the kernel's layers come first where
the kernel allows them: a crafted code object loaded with marshal, a bug in CPython or an extension module that
corrupts memory, and races between its path check and the operation (a folder renamed by another thread in
between). Python's own documentation says the same of audit hooks: they are not a sandbox by themselves.

Exit status: the code's own; EXIT_MEMORY after an uncaught MemoryError; EXIT_REFUSED after an uncaught refusal.
"""

import builtins
import linecache
import os
import posix
import sys
import traceback

EXIT_MEMORY = 117
EXIT_REFUSED = 118
CODE_NAME = "<tool>"


class Refused(PermissionError):
    """An operation the sandbox does not allow; the message names it."""


class RefusedImport(ImportError):
    """An import the sandbox does not allow; an ImportError, so optional imports fall back as usual."""


_DENIED = frozenset(
    {
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
        "subprocess.Popen", "pty.spawn", "os.startfile", "os.link", "os.symlink", "code.__new__",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "resource.setrlimit", "resource.prlimit",
        "sys._current_frames", "sys._current_exceptions",
    }
)  # fmt: skip
_DENIED_PREFIXES = ("socket.", "ctypes.")
# ctypes is refused at its import: in CPython 3.11 ctypes.cast and ctypes.memmove read and write any address without
# an audit event, which would let the code rewrite this hook. sympy imports ctypes (sympy.external.gmpy), so it does
# not import here.
_DENIED_IMPORTS = frozenset(
    {
        "ctypes", "_ctypes", "_posixsubprocess", "_posixshmem", "_multiprocessing", "_dbm", "_gdbm", "cffi",
        "_cffi_backend", "_xxsubinterpreters", "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase",
    }
)  # fmt: skip
_READS = frozenset({"os.listdir", "os.scandir", "os.getxattr", "os.listxattr"})
_CHANGES = {  # event -> positions of its path arguments
    "os.mkdir": (0,), "os.rmdir": (0,), "os.remove": (0,), "os.rename": (0, 1), "os.chmod": (0,), "os.chown": (0,),
    "os.utime": (0,), "os.truncate": (0,), "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,),
    "os.removexattr": (0,), "os.chdir": (0,), "sqlite3.connect": (0,),
}  # fmt: skip
_DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_S_IFMT, _S_IFLNK, _S_IFDIR = 0o170000, 0o120000, 0o040000
_MAX_LINKS = 40


def _install(work: str) -> None:
    """Install the hook. Everything it uses is bound here, as a local of this call (see the module docstring)."""
    lstat, stat, readlink, getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
    type_, issubclass_, list_, reversed_ = type, issubclass, list, reversed
    join_str, join_bytes, decode = "".join, b"".join, bytes.decode
    denied, denied_prefixes, denied_imports = _DENIED, _DENIED_PREFIXES, _DENIED_IMPORTS
    reads, devices, write_flags = _READS, _DEVICES, _WRITE_FLAGS
    changes, change_names = tuple(_CHANGES.items()), frozenset(_CHANGES)
    s_ifmt, s_iflnk, s_ifdir, max_links = _S_IFMT, _S_IFLNK, _S_IFDIR, _MAX_LINKS
    refused, refused_import = Refused, RefusedImport
    collected = []  # while installing: the roots, resolved by the same code that resolves the model's paths
    work_root, read_roots = None, ()

    def hook(event, args):
        if event in denied or event.startswith(denied_prefixes):
            raise refused(f"sandbox: {event} refused")
        if event == "import":
            name = args[0]
            name = join_str((name,)) if issubclass_(type_(name), str) else ""
            if name.partition(".")[0] in denied_imports:
                raise refused_import(f"sandbox: import of {name!r} refused")
            return
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writing = flags is not None and (flags & write_flags) != 0
            if mode is not None and issubclass_(type_(mode), str):
                mode = join_str((mode,))
                writing = writing or "w" in mode or "a" in mode or "x" in mode or "+" in mode
            checks = ((path, writing, True),)
        elif event in reads:
            checks = ((args[0], False, False),)
        elif event in change_names:
            checks = ()
            for name, positions in changes:
                if name == event:
                    checks = tuple((args[i], True, False) for i in positions)
        else:
            return
        for path, writing, opening in checks:
            if path is None:  # listdir() and scandir() of the working directory
                continue
            kind = type_(path)
            if kind is int or kind is bool:
                if writing and not opening:  # fchmod, ftruncate, fchdir ... on a descriptor: refused
                    raise refused(f"sandbox: {event} on a file descriptor refused")
                continue  # open(fd) wraps a descriptor already open; listdir(fd) lists one
            if issubclass_(kind, str):
                text = join_str((path,))
            elif issubclass_(kind, bytes):
                text = decode(join_bytes((path,)), "utf-8", "surrogateescape")
            else:
                raise refused(f"sandbox: {event} with a path that is not str, bytes or int refused")
            shown = text  # as the code wrote it, for the message
            # Resolve to an absolute path without symlinks, as the kernel would (a missing component stays as is).
            if not text.startswith("/"):
                text = getcwd() + "/" + text
            pending = list_(reversed_(text.split("/")))
            parts = []
            links = 0
            while pending:
                part = pending.pop()
                if part == "" or part == ".":
                    continue
                if part == "..":
                    if parts:
                        parts.pop()
                    continue
                candidate = "/" + "/".join(parts) + ("/" if parts else "") + part
                try:
                    mode_bits = lstat(candidate).st_mode
                except OSError:
                    parts.append(part)
                    continue
                if (mode_bits & s_ifmt) != s_iflnk:
                    parts.append(part)
                    continue
                links += 1
                if links > max_links:
                    raise refused(f"sandbox: {event} {shown!r} refused: too many symlinks")
                target = readlink(candidate)
                if target.startswith("/"):
                    parts = []
                pending.extend(reversed_(target.split("/")))
            resolved = "/" + "/".join(parts)
            if work_root is None:  # still inside _install: resolving a root itself
                collected.append(resolved)
                continue
            inside_work = resolved == work_root or resolved.startswith(work_root + "/")
            if inside_work or (resolved in devices and (opening or not writing)):
                continue
            if writing:
                raise refused(f"sandbox: {event} {shown!r} refused: outside the working directory {work_root}")
            if opening:
                try:
                    is_dir = (stat(resolved).st_mode & s_ifmt) == s_ifdir
                except OSError:
                    is_dir = False
                if is_dir:
                    raise refused(f"sandbox: {event} {shown!r} refused: a folder outside the working directory")
            for root in read_roots:
                if resolved == root or resolved.startswith(root + "/"):
                    break
            else:
                raise refused(
                    f"sandbox: {event} {shown!r} refused: outside the working directory and the Python installation"
                )

    # The roots go through the hook's own resolution before work_root is set (the hook only collects them then).
    for entry in [work] + [p for p in sys.path if p and os.path.isdir(p)]:
        hook("os.listdir", (entry,))
    work_root, read_roots = collected[0], tuple(collected[1:])
    sys.addaudithook(hook)


def _print_error(err: BaseException) -> None:
    """The traceback of the model's code, without this module's frames (its exec, and the hook where it refused)."""
    try:
        report = traceback.TracebackException(type(err), err, err.__traceback__)
        frames = [frame for frame in report.stack if frame.filename != "<sandbox>"]
        report.stack = traceback.StackSummary.from_list(frames)
        sys.stderr.write("".join(report.format()))
    except BaseException:  # noqa: BLE001  out of memory again, or an exception whose str raises
        sys.stderr.write(f"{type(err).__name__}\n")


def main() -> None:
    code_fd, work = int(sys.argv[2]), sys.argv[3]  # sys.argv[1]: this module's source
    sys.argv[:] = [CODE_NAME]  # what the code sees, as a script's name
    with os.fdopen(code_fd, encoding="utf-8", errors="replace") as f:
        source = f.read()
    linecache.cache[CODE_NAME] = (len(source), None, source.splitlines(True), CODE_NAME)  # lines in tracebacks
    _install(work)
    try:
        exec(compile(source, CODE_NAME, "exec"), {"__name__": "__main__", "__builtins__": builtins})  # noqa: S102
    except SystemExit:
        raise
    except MemoryError as err:
        _print_error(err)
        sys.stderr.flush()
        os._exit(EXIT_MEMORY)
    except (Refused, RefusedImport) as err:
        _print_error(err)
        sys.stderr.flush()
        os._exit(EXIT_REFUSED)
    except BaseException as err:  # noqa: BLE001  the model's own error: its traceback, exit status 1
        _print_error(err)
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
