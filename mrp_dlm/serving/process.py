"""`mrp serve`'s SGLang process: start it, wait until it answers, stop it and every process
it started.

SGLang's server is a process tree: the HTTP server and its scheduler and detokenizer
(`spawn` children). It runs in a session of its own, so a Ctrl-C in the terminal reaches
`mrp serve` only, which then stops the whole tree: SIGTERM to SGLang's main process (its
handler drains and stops its children; a SIGTERM to them too would read as a crash), and
after GRACE_SECONDS SIGKILL to the process group and to every descendant seen while it
ran. SIGTERM to `mrp serve` does the same as Ctrl-C. Before the start, the port is checked
as the server will meet it (SO_REUSEADDR, as uvicorn binds): the TIME-WAIT connections a
stopped server leaves do not block a restart; a listener does, and the error names it.

Deliberately not here: which command to run (see `launch.py`); printing (the CLI prints
what `serve` hands to `announce`).
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from mrp_dlm.model.release import write_sdar_view
from mrp_dlm.serving.launch import (HOST, LaunchPlan, ServeConfig, ServeError, check_sglang,
                                    describe, plan_launch, ready_message)

READY_PATH = "/health"  # 200 once SGLang has loaded the model and warmed up (503 before)
POLL_SECONDS = 1.0  # between readiness checks
GRACE_SECONDS = 20.0  # SIGTERM -> SIGKILL
COMMAND_CHARS = 160  # of a port holder's command line, in the "in use" error


def port_is_free(port: int) -> bool:
    """Whether SGLang's HTTP server can listen on HOST:port. The probe binds and listens as
    uvicorn does, with SO_REUSEADDR: a port that holds only TIME-WAIT connections (the
    connections of a server that just stopped under load, for up to a minute) is free, as
    it is for the server; a port something listens on is not. Errors other than "in use"
    (a privileged port, say) are a ServeError with the system's reason."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
            probe.listen(1)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise ServeError(f"cannot listen on port {port} on {HOST}: {error.strerror}; "
                             "choose another with --port") from error
    return True


def port_listeners(port: int) -> list[str]:
    """'process PID (command line)' of each process that listens on `port`, where the system
    tells: best effort (psutil reads /proc; another user's processes show no PID), and an
    empty list when it cannot tell."""
    try:
        import psutil  # an SGLang dependency
    except ImportError:
        return []
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    pids = sorted({c.pid for c in connections
                   if c.status == "LISTEN" and c.laddr and c.laddr.port == port})
    found = []
    for pid in pids:
        try:
            command = shlex.join(psutil.Process(pid).cmdline()) if pid else ""
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            command = ""
        found.append(f"process {pid} ({command[:COMMAND_CHARS] or '?'})" if pid
                     else "a process this user cannot see")
    return found


def time_wait_count(port: int) -> int:
    """TCP connections in TIME-WAIT on local port `port`: what a server that stopped under
    load leaves there for up to a minute, and what port_is_free lets through."""
    import psutil

    return sum(c.status == psutil.CONN_TIME_WAIT for c in psutil.net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port)


def check_port(port: int) -> None:
    """A ServeError naming who listens on `port` when the server could not listen there."""
    if port_is_free(port):
        return
    holders = port_listeners(port)
    who = f"{', '.join(holders)} listens there" if holders else "another server?"
    raise ServeError(f"port {port} on {HOST} is in use ({who}); choose another with --port")


def start(plan: LaunchPlan) -> subprocess.Popen:
    """The SGLang server, in a new session (its own process group), logging to our stdout
    and stderr."""
    return subprocess.Popen(plan.argv, env={**os.environ, **plan.env}, start_new_session=True)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_ready(process: subprocess.Popen, base_url: str) -> None:
    """Return once the server answers READY_PATH; an error if it exits first."""
    while not answers(base_url + READY_PATH):
        code = process.poll()
        if code is not None:
            raise ServeError(f"SGLang exited with code {code} before it was ready "
                             "(its log is above)")
        time.sleep(POLL_SECONDS)


def descendants(pid: int) -> list:
    import psutil  # an SGLang dependency

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def process_tree(pid: int) -> list:
    """psutil processes: `pid` and every descendant now."""
    import psutil

    return [psutil.Process(pid), *descendants(pid)]


def left_running(processes: list) -> list[str]:
    """'PID name' of each of `processes` (psutil) still running; zombies are not."""
    import psutil

    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {process.name()}")
        except psutil.NoSuchProcess:
            pass
    return alive


def signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop(process: subprocess.Popen, seen: list) -> None:
    """Stop the server: SIGTERM to its main process (SGLang then stops its children), and
    after GRACE_SECONDS SIGKILL to its process group and to every descendant in `seen`
    (psutil processes) or still attached."""
    import psutil

    tree = {p.pid: p for p in seen + descendants(process.pid)}
    if process.poll() is None:
        process.terminate()
    deadline = time.monotonic() + GRACE_SECONDS
    try:
        process.wait(timeout=GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(list(tree.values()),
                                 timeout=max(deadline - time.monotonic(), 0.1))
    signal_group(process.pid, signal.SIGKILL)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve(config: ServeConfig, extra_args: list[str], announce: Callable[[str], None]) -> int:
    """Run the server until it exits or this process is interrupted (Ctrl-C, SIGTERM);
    returns 0 when stopped so, else the server's exit code."""
    check_sglang()
    with tempfile.TemporaryDirectory(prefix="mrp-serve-") as tmp:
        yaml_path = Path(tmp) / "algorithm.yaml"
        plan = plan_launch(config, yaml_path, extra_args, dict(os.environ))
        check_port(plan.port)
        yaml_path.write_text(plan.yaml_text)
        if plan.view_of is not None:
            write_sdar_view(plan.view_of, plan.model_path)
        announce(f"mrp serve: {describe(config, plan)}\n{shlex.join(plan.argv)}")
        previous = signal.signal(signal.SIGTERM, interrupt)
        process = start(plan)
        seen = []
        try:
            wait_ready(process, plan.base_url)
            seen = descendants(process.pid)
            announce(ready_message(plan))
            return process.wait()
        except KeyboardInterrupt:
            announce("mrp serve: stopping the server")
            return 0
        finally:
            stop(process, seen)
            signal.signal(signal.SIGTERM, previous)
