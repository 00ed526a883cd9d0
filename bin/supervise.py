"""Start one ``relay server`` per port on one database and wait for them all (bin/two-servers).

    .venv/bin/python bin/supervise.py DATABASE_URL PORT [PORT ...]

SIGINT or SIGTERM is passed on to every server (each drains and stops). One server dying leaves
the others serving. The exit status is 0 when every server exited 0, else the last failing
server's (137 for one killed with SIGKILL).

Python waits for the servers, not bash: a trapped signal arriving just as a server died made
bash's ``wait`` lose that server's status (bash reaped it, then the trap jumped out of the wait
before recording it; every later wait returned -1, and the script exited 255 for a server
killed with SIGKILL). ``Popen.wait`` keeps every status, and a Python signal handler returns
into the wait rather than unwinding it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType


def main(url: str, ports: list[str]) -> int:
    """Serve ``url`` on 127.0.0.1 at each of ``ports``; return the exit status (see above)."""
    servers: list[subprocess.Popen[bytes]] = []
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for server in servers:
            server.send_signal(signal.SIGTERM)  # nothing for a server already reaped

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for port in ports:
        if stopping:
            break
        command = [".venv/bin/relay", "--database-url", url, "server"]
        servers.append(
            subprocess.Popen([*command, "--address", f"127.0.0.1:{port}"], stdin=subprocess.DEVNULL)
        )
    if stopping:  # a signal that came while a server was being started missed it
        stop(signal.SIGTERM, None)
    status = 0
    for server in servers:
        code = server.wait()
        if code != 0:
            status = 128 - code if code < 0 else code  # -9 (SIGKILL) -> 137, as a shell says
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
