"""``Conn.abort`` on uvloop, whose transport's socket (a ``PseudoSocket``) raises
``ValueError``, not ``OSError``, once its file descriptor is closed."""

from __future__ import annotations

import asyncio

import uvloop

from queue_core.protocol.budget import ReplyBudget
from queue_core.protocol.connection import Conn, Slots


def test_an_abort_after_the_socket_closed_raises_nothing_on_uvloop() -> None:
    # A shutdown aborts every connection still open, some with their socket closed already:
    # setting the reset on the closed socket raised ValueError and ended the shutdown with a
    # traceback (a hostile review).
    async def main() -> bool:
        aborted = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            budget = ReplyBudget(1 << 20, 1 << 20, [], asyncio.get_running_loop().time)
            conn = Conn(reader, writer, "peer", Slots(4), budget)
            writer.transport.abort()
            sock = writer.get_extra_info("socket")
            for _ in range(100):  # loop passes until uvloop has closed the descriptor
                if sock.fileno() < 0:
                    break
                await asyncio.sleep(0)
            assert sock.fileno() < 0
            try:
                conn.abort()
            except BaseException as exc:  # reported to the test
                aborted.set_exception(exc)
            else:
                aborted.set_result(conn.resetting)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return bool(await asyncio.wait_for(aborted, 15))
        finally:
            writer.close()
            server.close()

    assert uvloop.run(main()) is True
