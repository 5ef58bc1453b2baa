"""A fork server ("zygote") for the services of ``fedfleet run``: client hosts share torch's pages.

Why: every client host imports torch, and torch alone is ~146 MB of *private* memory in each process
that imports it (benchmarks/results-scale.md). A process that has imported torch, numpy and the
services once, and then forks each service, shares those pages copy-on-write with all of them; PSS
splits them instead of counting them once per process. Android's zygote and multiprocessing's
``forkserver`` do the same.

How (Linux only):

* :class:`ForkServer` (the orchestrator's side) starts ``python -m services.zygote`` as its child;
  the orchestrator is a *child subreaper* (``PR_SET_CHILD_SUBREAPER``) while it starts the zygote
  and while each fork is under way, and only then.
* The zygote imports :data:`PRELOAD` — imports only: no tensor is made and no thread pool is used,
  so the fork is from a single-threaded process (torch's intra-op pool is OpenMP; a pool that ran
  before a fork can hang the child) — then reads one JSON request per line on its stdin.
* For each request it forks twice: the middle process forks the service and exits at once, so the
  service is re-parented to the nearest subreaper, the orchestrator. The orchestrator is then the
  service's real parent: ``waitpid`` gives it the exit status, and :func:`adopt` wraps the pid in a
  ``subprocess.Popen``, so ``poll/wait/send_signal/terminate/kill/returncode`` behave exactly as
  for a service started with ``subprocess`` (the kernel keeps a dead service's pid as a zombie until
  the orchestrator reaps it: a signal can never reach a recycled pid).
* The service (:func:`_become`) redirects stdout/stderr to its log file, takes the environment and
  working directory it would have had, restores the signal dispositions of a fresh interpreter,
  re-seeds numpy's legacy global RNG (a fresh interpreter seeds it from the OS; a fork would inherit
  the zygote's state, the same in every child), rewrites its command line to
  ``python -m services.cli <argv>`` (what ``ps``, humans and ``benchmarks/bench_rounds._roles``
  look for) and runs ``services.cli.main``; it exits with the code the interpreter would have.

What stays as before: torch's default generator is never drawn from in the zygote, so it is in the
state a fresh import leaves (every service seeds what it draws from itself, ``shared.experiment``),
and Python's ``random`` re-seeds itself after a fork. Settings a service reads at import time cannot
change per service: the orchestrator forks a service only when its environment differs from the
zygote's in ``FEDFLEET_*``/``RABBITMQ_*`` variables alone (read when the service starts), and starts
it as a plain subprocess otherwise. ``FEDFLEET_FORK_SERVER=false`` turns the fork server off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import re
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]

#: what the zygote imports before it forks: torch and everything a client host's or the server's
#: start-up imports (``services.cli`` imports them lazily, inside the commands). Imports only.
PRELOAD = (
    "numpy",
    "numpy.random",  # seeds its legacy global RNG at import: re-seeded in each service (_become)
    "torch",
    "pika",
    "prometheus_client",
    "services.cli",
    "services.common",
    "services.client.service",
    "services.client.capacity",
    "services.server.service",
    "shared.experiment",
    "shared.algorithms.training",
    "shared.metrics",
    "shared.transport.amqp",
    # the first ``torch.optim`` optimizer a process makes imports torch._dynamo (~800 modules, sympy
    # among them: 4 s on a quiet machine, 10-20 s at load 10). Imported here, it is shared, and no
    # host stalls in its first round (long enough, on a busy machine, to miss its heartbeats)
    "torch._dynamo",
)

#: the roles the orchestrator starts from the zygote: the ones that import torch (an aggregator of
#: the FedAvg family does not, and stays a lean subprocess)
FORKED_ROLES = frozenset({"server", "client"})

#: environment variables a service reads when it starts, not when a module is imported: a service
#: whose environment differs from the zygote's only in these can be forked
RUNTIME_ENV_PREFIXES = ("FEDFLEET_", "RABBITMQ_")

#: bytes of command line the zygote reserves (it starts with a padding argument of this size), so
#: that each service can write its own ``python -m services.cli ...`` over it
CMDLINE_BYTES = 8192

_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


class ForkServerError(RuntimeError):
    """The zygote could not start a service (it died, or refused the request)."""


def _prctl(option: int, arg: int | bytes) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(option, arg, 0, 0, 0) == 0)


def subreaper(on: bool) -> bool:
    """Make this process the reaper of its orphaned descendants, or no longer (False: refused).

    Why: the services the zygote forks are re-parented here, so this process can wait for them.
    Only for as long as a fork takes (:meth:`ForkServer.spawn`): any other descendant orphaned while
    this process is a subreaper is re-parented here too, and nobody here would reap it (Erlang's
    ``inet_gethost`` helpers of ``rabbitmqctl`` piled up as zombies under pytest when this was
    permanent).
    """
    return sys.platform == "linux" and _prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0)


def forkable(role: str, env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a service of ``role`` with ``env`` can be forked from a zygote started with
    ``zygote_env`` (see :data:`FORKED_ROLES`, :data:`RUNTIME_ENV_PREFIXES`)."""
    if role not in FORKED_ROLES:
        return False
    differs = {k for k in env.keys() | zygote_env.keys() if env.get(k) != zygote_env.get(k)}
    return all(k.startswith(RUNTIME_ENV_PREFIXES) for k in differs)


def adopt(pid: int, args: list[str]) -> subprocess.Popen[bytes]:
    """A ``subprocess.Popen`` for ``pid``, a child of this process that was not started by ``Popen``.

    Why a real ``Popen``: the tests and ``ProcessCluster`` use ``.p.poll()``, ``.p.wait()``,
    ``.p.send_signal()``... and ``Popen`` implements them on ``waitpid``/``kill`` of ``pid`` alone.
    The attributes are the ones ``Popen.__init__`` sets before it starts a child (CPython 3.11;
    tests/test_zygote.py exercises every method used).
    """
    p: subprocess.Popen[bytes] = subprocess.Popen.__new__(subprocess.Popen)
    attrs: dict[str, Any] = {
        "args": args,
        "stdin": None,
        "stdout": None,
        "stderr": None,
        "pid": pid,
        "returncode": None,
        "encoding": None,
        "errors": None,
        "text_mode": False,
        "pipesize": -1,
        "_input": None,
        "_communication_started": False,
        "_waitpid_lock": threading.Lock(),
        "_sigint_wait_secs": 0.25,
        "_closed_child_pipe_fds": True,
        "_child_created": True,
    }
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


class ForkServer:
    """The orchestrator's handle on a zygote: :meth:`spawn` starts a service, :meth:`close` ends it.

    ``env`` is the zygote's environment (the cluster's); ``log`` its own log file.
    """

    def __init__(self, env: dict[str, str], log: Path, *, start_timeout_s: float = 300) -> None:
        if not (subreaper(True) and subreaper(False)):  # whether it can, before anything starts
            raise ForkServerError("this process cannot become a child subreaper (Linux only)")
        self._ready = False
        self.env = dict(env)
        self.log = log
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._fh = log.open("wb")
        pad = "-" * CMDLINE_BYTES
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.zygote", pad],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._fh,
            env=self.env,
            cwd=ROOT,
        )

    def spawn(
        self, argv: list[str], log: Path, env: dict[str, str], cwd: Path, *, module: str = "services.cli"
    ) -> subprocess.Popen[bytes]:
        """Fork ``python -m <module> <argv>`` with stdout/stderr to ``log``; its ``Popen``."""
        request = {"module": module, "argv": argv, "log": str(log), "env": env, "cwd": str(cwd)}
        with self._lock:
            if not self._ready:  # the zygote's preload: seconds, outside the subreaper window
                self._read_line()
                self._ready = True
            assert self.proc.stdin is not None
            subreaper(True)
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
                reply = self._read_line()
            except BrokenPipeError:
                raise ForkServerError(self._died()) from None
            finally:
                subreaper(False)
        if "pid" not in reply:
            raise ForkServerError(str(reply.get("error")))
        return adopt(int(reply["pid"]), [sys.executable, "-m", module, *argv])

    def _read_line(self) -> dict[str, Any]:
        """The zygote's next JSON line (its readiness, or a reply)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.start_timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise ForkServerError(self._died() if ready else f"no answer in {self.start_timeout_s} s")
        return dict(json.loads(line))

    def _died(self) -> str:
        rc = self.proc.wait(5)
        tail = self.log.read_text(errors="replace")[-2000:]
        return f"the fork server exited with {rc}; {self.log}:\n{tail}"

    def close(self, timeout: float = 10) -> None:
        """End the zygote (its stdin closes; it exits). The services it forked go on running."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._fh.close()


# -- the zygote process ----------------------------------------------------------------------------
def set_cmdline(args: list[str], name: str | None = None) -> bool:
    """Write ``args`` over this process's command line (``/proc/self/cmdline``); False if they do not
    fit in the bytes the process was started with. ``name`` also becomes its ``comm`` (``top``).

    How: the kernel shows the bytes between ``arg_start`` and ``arg_end`` (``/proc/self/stat``), the
    original argv strings on the stack, which CPython no longer reads after start-up (setproctitle
    does the same). The rest is filled with NULs, so the list reads as ``args`` plus empty strings.
    """
    if name:
        _prctl(_PR_SET_NAME, name.encode()[:15])
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
    data = b"\0".join(a.encode() for a in args) + b"\0"
    if not start or len(data) > end - start:
        return False
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
    return True


def _become(request: dict[str, Any], keep: tuple[int, ...]) -> None:
    """In the forked service: become ``python -m <module> <argv>`` and exit with its code.

    ``runpy.run_module(..., run_name="__main__")`` is what ``python -m`` itself does, so the
    service runs its ``if __name__ == "__main__"`` block as in a new interpreter.
    """
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in {log, null, *keep}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        module = str(request.get("module") or "services.cli")
        argv = [str(a) for a in request["argv"]]
        role = argv[0] if argv else module
        ident = argv[argv.index("--id") + 1] if "--id" in argv[:-1] else role
        set_cmdline([sys.executable, "-m", module, *argv], name=ident)
        if "numpy.random" in sys.modules:  # seeded in the zygote: every service would repeat it
            sys.modules["numpy.random"].seed()  # fresh entropy, as in a new interpreter
        sys.argv = [module, *argv]  # run_module puts the module's file in sys.argv[0]
        # runpy warns that the module was imported before it ran as __main__: the zygote preloaded
        # it on purpose (a new interpreter would import it again from the same file)
        warnings.filterwarnings(
            "ignore", message=rf"'{re.escape(module)}' found in sys.modules", category=RuntimeWarning
        )
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # what the interpreter does with SystemExit
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # a fresh interpreter dies of SIGINT after the traceback
        traceback.print_exc()
        _exit_quietly()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit_quietly(code)


def _exit_quietly(code: int | None = None) -> None:
    """Run the exit handlers and flush, as interpreter shutdown would; then ``_exit(code)``."""
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if code is not None:
        os._exit(code & 0xFF)


def _fork_service(request: dict[str, Any], keep: tuple[int, ...]) -> int:
    """Fork twice (the middle process exits at once, so the service is re-parented to the
    orchestrator, the subreaper); the service's pid."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _become(request, keep)
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    os.waitpid(middle, 0)  # gone before the answer: the service is the orchestrator's child by then
    if not data:
        raise ForkServerError("the intermediate process exited without a pid")
    return int(data)


def serve() -> int:
    """The zygote: preload, then fork one service per request line on stdin until stdin closes."""
    # the protocol keeps its own copies of stdin/stdout; fd 0 becomes /dev/null and fd 1 the log
    # (stderr), so a library that prints can never write into the protocol
    proto_in: IO[bytes] = os.fdopen(os.dup(0), "rb")
    proto_out: IO[bytes] = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    set_cmdline([sys.executable, "-m", "services.zygote"], name="fedfleet-zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the services; stdin's EOF ends us
    for module in PRELOAD:
        importlib.import_module(module)
    # what the gc module's docs advise before fork without exec: collect once, then move every
    # object into the permanent generation, so that no collection in a service writes to the
    # zygote's objects (which would copy their pages) or spends time walking them
    gc.collect()
    gc.freeze()
    threads = len(os.listdir("/proc/self/task"))
    print(json.dumps({"event": "zygote_ready", "preloaded": len(sys.modules), "os_threads": threads}))
    proto_out.write(b'{"ready": true}\n')
    proto_out.flush()
    keep = (proto_in.fileno(), proto_out.fileno())
    for line in proto_in:
        try:
            pid = _fork_service(json.loads(line), keep)
            reply: dict[str, Any] = {"pid": pid}
        except Exception as err:  # one bad request must not end the zygote
            reply = {"error": f"{type(err).__name__}: {err}"}
        proto_out.write(json.dumps(reply).encode() + b"\n")
        proto_out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(serve())
