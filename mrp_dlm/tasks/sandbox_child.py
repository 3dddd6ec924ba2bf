"""Child side of the Python sandbox: the script `sandbox.py` runs as `python -I -S <this file>`.

It reads one JSON request from stdin, lowers its own resource limits, tries to leave the
network namespace, installs an audit hook and only then compiles and runs the untrusted
code. The outcome goes back as one JSON line on a private copy of stdout; the untrusted
code's own stdout and stdin are `/dev/null`.

Deliberately not here: timeouts, killing and cleanup (the parent owns those), and any import
from `mrp_dlm` (the child runs without `site`, from the stdlib only). Audit hooks are a
best-effort tripwire, not a security boundary; the rlimits, the empty environment, the
throwaway working directory and the parent's kill are the other layers.
"""

import json
import os
import resource
import sys

CLONE_NEWNET = 0x40000000  # from <sched.h>
RESERVE_BYTES = 1 << 20  # kept aside so a MemoryError can still be reported

# Audit events refused outright, by exact name or by prefix.
DENIED_EVENTS = frozenset({
    "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.startfile",
    "os.posix_spawn", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
    "sqlite3.connect", "sqlite3.enable_load_extension", "sqlite3.load_extension",
})
DENIED_PREFIXES = ("socket.", "subprocess.", "ctypes.", "os.exec", "os.spawn", "pty.")
# Extension modules that reach fork/exec or raw memory without an audit event of their own.
DENIED_IMPORTS = frozenset({"_posixsubprocess", "_ctypes", "ctypes", "_xxsubinterpreters"})
# Audit events that change the file system: event name -> positions of its path arguments.
PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,),
    "os.chown": (0,), "os.chflags": (0,), "os.lchflags": (0,), "os.truncate": (0,),
    "os.utime": (0,), "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,),
    "os.removexattr": (0,), "shutil.rmtree": (0,), "os.rename": (0, 1),
    "os.link": (0, 1), "os.symlink": (0, 1),
}
# Function attributes whose replacement would let code rewrite the hook itself.
GUARDED_ATTRIBUTES = frozenset({"__code__", "__globals__", "__closure__"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def set_limits(request):
    """Lower this process's limits; as root RLIMIT_NPROC is not enforced, which is fine."""
    cpu = int(request["cpu_seconds"])
    limits = [
        (resource.RLIMIT_AS, int(request["memory_bytes"])),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, int(request["file_bytes"])),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_CORE, 0),
    ]
    for kind, soft in limits:
        hard = soft + 1 if kind == resource.RLIMIT_CPU else soft
        try:
            resource.setrlimit(kind, (soft, hard))
        except (ValueError, OSError):
            pass


def leave_network():
    """Best effort: a fresh, empty network namespace (needs CAP_SYS_ADMIN)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(CLONE_NEWNET)
    except Exception:
        pass
    for name in ("ctypes", "ctypes._endian", "_ctypes"):
        sys.modules.pop(name, None)


def silence_streams():
    """Point fds 0 and 1 at /dev/null; return a private fd for the result line."""
    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stderr = sys.stdout
    return result_fd


def is_write_open(args):
    mode = args[1] if len(args) > 1 else None
    flags = args[2] if len(args) > 2 else 0
    if isinstance(mode, str) and any(char in mode for char in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def make_audit_hook(root, violations):
    """The hook, closed over an immutable root path and the shared list of violations."""
    prefix = os.path.realpath(root) + os.sep
    realpath, fspath, fsdecode = os.path.realpath, os.fspath, os.fsdecode

    def inside(path):
        if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
            return False
        return (realpath(fsdecode(fspath(path))) + os.sep).startswith(prefix)

    def refuse(event):
        violations.append(event)
        raise PermissionError(f"sandbox refused {event}")

    def hook(event, args):
        if event in DENIED_EVENTS or event.startswith(DENIED_PREFIXES):
            refuse(event)
        elif event == "import" and args[0] in DENIED_IMPORTS:
            refuse(f"import {args[0]}")
        elif event == "open":
            if is_write_open(args) and not isinstance(args[0], int) and not inside(args[0]):
                refuse(f"open for writing {args[0]!r}")
        elif event in PATH_EVENTS:
            if not all(inside(args[index]) for index in PATH_EVENTS[event]):
                refuse(f"{event} {args[0]!r}")
        elif event == "object.__setattr__" and len(args) > 1 and args[1] in GUARDED_ATTRIBUTES:
            refuse(f"set {args[1]}")

    return hook


def describe(error):
    return f"{type(error).__name__}: {error}"


def execute(request):
    """Compile, run and call; returns the result dict (status, value, error)."""
    reserve = bytearray(RESERVE_BYTES)
    try:
        namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
        exec(compile(request["code"], "<solution>", "exec"), namespace)
        if request["call"] is None:
            return {"status": "ok", "value": None, "error": None}
        value = repr(eval(request["call"], namespace))
        return {"status": "ok", "value": value[: request["max_value_chars"]], "error": None}
    except MemoryError:
        del reserve
        return {"status": "memory_exceeded", "value": None, "error": "MemoryError"}
    except BaseException as error:
        return {"status": "error", "value": None, "error": describe(error)[:2000]}


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def main():
    request = json.loads(sys.stdin.buffer.read())
    if request["isolate_network"]:
        leave_network()
    set_limits(request)
    result_fd = silence_streams()
    os.environ["TMPDIR"] = os.getcwd()
    violations = []
    sys.addaudithook(make_audit_hook(os.getcwd(), violations))
    result = execute(request)
    if violations:
        result = {"status": "error", "value": None, "error": f"SandboxViolation: {violations[0]}"}
    write_all(result_fd, ("\n" + json.dumps(result) + "\n").encode())
    # _exit skips atexit handlers and the join of non-daemon threads the code may have left.
    os._exit(0)


if __name__ == "__main__":
    main()
