"""The server's listening socket, bound before anything else starts: a port in use or out of range is refused at
once, in a sentence, before a model is opened or anything announces an address."""
from __future__ import annotations

import errno
import socket


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening; OSError whose message says why not, for the user."""
    if not 0 <= port < 65536:  # 0: any free port
        raise OSError(errno.EINVAL, f"port {port} is not a port number (1 to 65535)")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        raise OSError(errno.EADDRNOTAVAIL, f"{host} is not an address or a name this machine can resolve") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A port this server used a moment ago may still have closed connections in TIME_WAIT: allowed again at
    # once. A port another program listens on is still refused (Linux and macOS both).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # clients may connect from now on; the server accepts them once its loop runs
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(e.errno, f"port {port} is already in use by another program") from None
        if e.errno == errno.EACCES:
            raise OSError(e.errno, f"port {port} needs administrator rights; choose one above 1023") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise OSError(e.errno, f"{host} is not an address of this machine") from None
        raise
    return sock
