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

from services.orchestrator import ROOT

#: a starting host that gets SIGTERM inside a weakref callback and inside a class body's
#: ``__set_name__``, then does what ``cmd_client`` does once it has joined
SCRIPT = """
import gc, os, signal, weakref
from services import cli

signal.signal(signal.SIGTERM, cli._leave_before_joining)

def term_and_spin():
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100_000):  # the handler runs in here
        pass

class Thing:
    pass

thing = Thing()
ref = weakref.ref(thing, lambda _: term_and_spin())
del thing
gc.collect()

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


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_sigterm_while_the_host_starts_raises_nowhere_and_is_honoured_once_it_has_joined() -> None:
    done = _run(SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr and "Error" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["still running", "terminate", "terminated set"]


def test_a_sigterm_while_the_host_waits_to_join_ends_it_at_once_with_exit_0() -> None:
    done = _run(JOINING)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "" and "Traceback" not in done.stderr, (done.stdout, done.stderr[-2000:])


def test_a_sigterm_recorded_before_the_join_ends_the_host_before_it_joins() -> None:
    done = _run(EARLY_THEN_JOIN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["recorded"]


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
