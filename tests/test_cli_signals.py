"""A SIGTERM that reaches a client host while it starts is never lost, and never an error.

Before the host joins there is nothing to hand back, so a SIGTERM should end it with exit 0. But an
exception raised by a signal handler lands wherever the main thread happens to be: inside a callback
Python runs for itself (an import's module-lock callback, a weakref callback) it is lost ("Exception
ignored"; a clean-clone CI run saw a pod scaled away while it imported go on to join, serve and
idle), and inside a class body's ``__set_name__`` (scikit-learn's import) it becomes a
``RuntimeError`` and exit 1 (CI at 971e80d: a Kubernetes failure). So the handler
(``services.cli._leave_before_joining``) only records the request, which the start honours at its
next step, and raises only while the host waits for its join answer (``services.cli._joining``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.orchestrator import ROOT

#: a starting host that gets one SIGTERM inside a weakref callback or inside a class body's
#: ``__set_name__``, then does what ``cmd_client`` does once it has joined
SCRIPT = """
import gc, os, signal, sys, weakref
from services import cli

signal.signal(signal.SIGTERM, cli._leave_before_joining)

def term_and_spin():
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100_000):  # the handler runs in here
        pass

if sys.argv[1] == "weakref":
    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing, lambda _: term_and_spin())
    del thing
    gc.collect()
else:
    class Named:
        def __set_name__(self, owner, name):
            term_and_spin()

    class Owner:
        attribute = Named()

print("still running", flush=True)

class Client:
    def terminate(self):
        print("terminate", flush=True)

cli._honour_early_term(Client())
print("terminated set" if cli._TERMINATED.is_set() else "terminated not set", flush=True)
"""

#: a host waiting for its join answer: a SIGTERM ends it at once, with exit 0
JOINING = """
import os, signal, time
from services import cli

signal.signal(signal.SIGTERM, cli._leave_before_joining)
with cli._joining():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("not interrupted", flush=True)
"""

#: a SIGTERM recorded while starting: the join is not even attempted
EARLY_THEN_JOIN = """
import os, signal
from services import cli

signal.signal(signal.SIGTERM, cli._leave_before_joining)
os.kill(os.getpid(), signal.SIGTERM)
print("recorded", flush=True)
with cli._joining():
    print("joined", flush=True)
"""


#: a second signal while starting: whoever sent it will not wait for the next step
TWICE = """
import os, signal
from services import cli

signal.signal(signal.SIGTERM, cli._leave_before_joining)
os.kill(os.getpid(), signal.SIGTERM)
print("recorded", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("not left", flush=True)
"""

#: ``cmd_client`` itself, its experiment and broker stubbed: which of its steps a SIGTERM may cut
CMD_CLIENT = """
import signal
from services import cli
from services.client import capacity, service

class Stop(Exception):
    pass

def login(url, exp, given):
    print("login interruptible" if cli._INTERRUPTIBLE else "login not interruptible", flush=True)
    return url, "h"

def transport(url, exp):
    print("connect interruptible" if cli._INTERRUPTIBLE else "connect not interruptible", flush=True)
    raise Stop

cli._experiment = lambda cfg, path: type("E", (), {"full_footprint_bytes": 1})()
service.per_device_bytes = lambda exp: 1
capacity.host_budget = lambda *a: (1, 1)
cli._host_login, cli._transport = login, transport
args = cli.build_parser().parse_args(
    ["client", "--config", "experiments/quickstart.yaml", "--metrics-port", "0"]
)
try:
    args.fn(args)
except Stop:
    pass
print("after" if not cli._INTERRUPTIBLE else "still interruptible", flush=True)
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("where", ["weakref", "set_name"])
def test_a_sigterm_while_the_host_starts_raises_nowhere_and_is_honoured_once_it_has_joined(
    where: str,
) -> None:
    done = _run(SCRIPT, where)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["still running", "terminate", "terminated set"]


def test_a_sigterm_while_the_host_waits_to_join_ends_it_at_once_with_exit_0() -> None:
    done = _run(JOINING)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "" and "Traceback" not in done.stderr, (done.stdout, done.stderr[-2000:])


def test_a_sigterm_recorded_before_the_join_ends_the_host_before_it_joins() -> None:
    done = _run(EARLY_THEN_JOIN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["recorded"]


def test_a_second_sigterm_while_the_host_starts_ends_it_at_once() -> None:
    done = _run(TWICE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["recorded"]


def test_the_hosts_join_and_connection_are_the_steps_a_sigterm_cuts_short() -> None:
    done = _run(CMD_CLIENT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["login interruptible", "connect interruptible", "after"]


def test_without_an_early_sigterm_a_host_is_not_told_to_leave() -> None:
    from services import cli

    class Client:
        terminated = False

        def terminate(self) -> None:
            self.terminated = True

    client = Client()
    assert not cli._TERMINATED_EARLY.is_set()
    cli._honour_early_term(client)
    assert not client.terminated
