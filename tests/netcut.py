"""A TCP relay whose network can be cut: what a site's network drop looks like to Flower.

A SuperNode dials the relay's port instead of the SuperLink's; the relay copies bytes
both ways. :meth:`Relay.cut` drops the network as a lost route does: nothing more passes
on the connections it carries (they stay open, silent, as TCP keeps them through an
outage), and new connections fail (refused). :meth:`Relay.restore` brings the network
back: the open connections carry on, new ones are accepted. TLS passes through
unchanged (the certificate names the host, not the port).
"""

from __future__ import annotations

import socket
import threading


class Relay:
    """Relay ``127.0.0.1:port`` (a free port) to ``target`` (``(host, port)``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.up = threading.Event()
        self.closed = False
        self.connections: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.restore()

    def cut(self) -> None:
        """The network drops."""
        self.up.clear()
        _close(self.listener)

    def restore(self) -> None:
        """The network is back."""
        if self.listener.fileno() == -1:
            self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()
        self.up.set()

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.up.set()  # the pipes see their sockets closed and end
        for sock in self.connections:
            _close(sock)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            self.connections += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.up.wait()
                if self.closed:
                    break
                sink.sendall(data)
        except OSError:
            pass
        _close(source)
        _close(sink)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
