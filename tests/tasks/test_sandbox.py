"""The sandbox refuses what it must, reports every failure as a result, and never raises."""

import os

import pytest

from mrp_dlm.tasks.sandbox import Outcome, SandboxLimits, run_many, run_python

FAST = SandboxLimits(timeout_s=1.0)


def run(code: str, call: str | None = None, limits: SandboxLimits = FAST):
    return run_python(code, call, limits)


def assert_refused(result, fragment: str) -> None:
    assert result.outcome is Outcome.ERROR, result
    assert "SandboxViolation" in result.error and fragment in result.error, result.error


def test_function_returns_value():
    result = run("def solve():\n    x = 7\n    x = x + 5\n    return x\n", "solve()")
    assert result.ok and result.value == "12" and result.error is None


def test_value_is_repr_and_prints_do_not_interfere():
    result = run("print('noise')\ndef solve():\n    print('more')\n    return [1, 'a']", "solve()")
    assert result.ok and result.value == "[1, 'a']"


def test_without_call_runs_code_only():
    result = run("x = 1 + 1")
    assert result.ok and result.value is None


def test_syntax_error_is_an_error_not_a_crash():
    result = run("def solve(:\n    return 1", "solve()")
    assert result.outcome is Outcome.ERROR and result.error.startswith("SyntaxError")


def test_exception_text_is_reported():
    result = run("def solve():\n    return 1 // 0", "solve()")
    assert result.outcome is Outcome.ERROR and "ZeroDivisionError" in result.error


def test_missing_function_is_an_error():
    assert run("x = 3", "solve()").outcome is Outcome.ERROR


def test_sys_exit_is_an_error():
    assert run("import sys\nsys.exit(0)").outcome is Outcome.ERROR


def test_infinite_loop_times_out():
    result = run("while True:\n    pass")
    assert result.outcome is Outcome.TIMED_OUT
    assert result.duration_s < 3.0


def test_sleep_times_out():
    assert run("import time\ntime.sleep(60)").outcome is Outcome.TIMED_OUT


@pytest.mark.parametrize("code", [
    "x = bytearray(2 * 1024 ** 3)",
    "chunks = []\nwhile True:\n    chunks.append(' ' * 10 ** 6)",
])
def test_memory_bomb_is_stopped(code):
    # A generous wall clock: on a loaded machine the bomb may need more than a second to
    # reach the memory limit, and that must not read as a timeout.
    result = run(code, limits=SandboxLimits(timeout_s=20.0))
    assert result.outcome is Outcome.MEMORY_EXCEEDED, result


def test_write_outside_temp_dir_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    assert_refused(run(f"open({str(target)!r}, 'w').write('x')"), "open for writing")
    assert not target.exists()


def test_os_open_for_writing_outside_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    result = run(f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)")
    assert_refused(result, "open for writing")
    assert not target.exists()


def test_remove_outside_temp_dir_is_refused(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    assert_refused(run(f"import os\nos.remove({str(victim)!r})"), "os.remove")
    assert victim.exists()


def test_symlink_escape_is_refused(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    code = f"import os\nos.symlink({str(victim)!r}, 'link')\nopen('link', 'w').write('gone')"
    assert_refused(run(code), "os.symlink")
    assert victim.read_text() == "keep"


def test_reading_is_allowed():
    result = run("import os\ndef solve():\n    return len(open(os.__file__).read()) > 0", "solve()")
    assert result.ok and result.value == "True"


def test_refusal_counts_even_when_caught():
    code = ("try:\n    open('/tmp/escaped.txt', 'w')\nexcept Exception:\n    pass\n"
            "def solve():\n    return 1")
    assert_refused(run(code, "solve()"), "open for writing")


def test_temp_dir_is_writable_then_deleted():
    code = ("import os\nopen('a.txt', 'w').write('x')\nos.mkdir('d')\n"
            "os.rename('a.txt', 'd/b.txt')\n"
            "def solve():\n    return os.getcwd()")
    result = run(code, "solve()")
    assert result.ok
    workdir = eval(result.value)
    assert os.path.basename(workdir).startswith("mrp-sandbox-")
    assert not os.path.exists(workdir)


def test_environment_is_empty():
    result = run("import os\ndef solve():\n    return sorted(os.environ)", "solve()")
    assert result.ok
    assert not {"PATH", "HOME", "PYTHONPATH"} & set(eval(result.value))


def test_socket_is_refused():
    assert_refused(run("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)"),
                   "socket")


@pytest.mark.parametrize("code, fragment", [
    ("import subprocess\nsubprocess.run(['true'])", "_posixsubprocess"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.fork()", "os.fork"),
    ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
    ("import os\nos.kill(1, 0)", "os.kill"),
])
def test_process_spawning_is_refused(code, fragment):
    assert_refused(run(code), fragment)


def test_ctypes_is_refused():
    assert_refused(run("import ctypes\nctypes.CDLL(None)"), "ctypes")


def test_limits_cannot_be_raised():
    assert_refused(run("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))"),
                   "resource.setrlimit")


def test_run_many_keeps_order_and_isolates_failures():
    codes = [f"def solve():\n    return {index}" for index in range(12)] + ["def solve(:"]
    results = run_many(codes, "solve()", FAST, max_workers=4)
    assert [result.value for result in results[:12]] == [str(index) for index in range(12)]
    assert results[12].outcome is Outcome.ERROR


def test_limits_are_validated():
    with pytest.raises(ValueError):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError):
        SandboxLimits(memory_mb=1)
