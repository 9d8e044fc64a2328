"""A watchdog that ends every rank of a distributed run when one rank is lost, instead of leaving the others blocked
in a collective forever.

With MLX's ``ring`` backend a collective raises ``[ring] connection to a peer was lost`` in the other ranks when a
rank's process ends (its sockets close), without naming the rank, and waits forever when a rank stops answering with its
sockets still open (a stopped or frozen process, or a host that lost power or its link: alike over TCP): MLX's
collectives have no timeout. So each rank other than 0 keeps one TCP connection to rank 0, a side channel independent of
the backend, and a daemon thread on each end sends a heartbeat every ``interval`` seconds. A connection that closes
without a goodbye, or no heartbeat for ``timeout`` seconds, means that rank is lost: rank 0 tells the others, and every
remaining rank prints ``kimi-mlx: error: rank K (host) lost: ...`` and ends its process with status 1 (``os._exit``: its
main thread may be blocked inside a collective, where no exception can reach it).

A rank that ends normally (or by an exception that reaches the interpreter's exit) says goodbye at exit and waits
for rank 0's answer, so ranks that finish at different times raise no alarm, and a rank that leaves just after a
peer was lost still hears about it and exits with the error.

Rank 0 listens on ``KIMI_MLX_COORDINATOR`` (``host`` or ``host:port``; set it where the hosts reach rank 0 by another
address, or to fix the port) or else on a free port of rank 0's address for the backend: the first entry of
``MLX_HOSTFILE`` (ring), ``MLX_JACCL_COORDINATOR`` (jaccl), ``NCCL_HOST_IP`` (nccl), its host name otherwise (mpi).
The address reaches the other ranks with one ``all_gather``. ``KIMI_MLX_PEER_TIMEOUT`` sets the timeout in seconds.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .health import gather_bytes

TIMEOUT_ENV = "KIMI_MLX_PEER_TIMEOUT"
COORDINATOR_ENV = "KIMI_MLX_COORDINATOR"
DEFAULT_TIMEOUT = 20.0  # seconds without a heartbeat before a rank counts as lost
EXIT_STATUS = 1
DRAIN_SECONDS = 2.0  # rank 0 waits at most this long for the others to read its last message
HANDSHAKE_SECONDS = 30.0  # for every rank to connect to rank 0 once the address is known (busy hosts are slow)

_active: Optional["Watchdog"] = None


def watch(group: Optional[mx.distributed.Group], timeout: Optional[float] = None) -> Optional["Watchdog"]:
    """Start this process's watchdog over ``group`` (every rank must call it: the address of rank 0 is exchanged with
    ``all_gather``); later calls return the running one. None for no group or a group of one. ``timeout``: seconds without a heartbeat before a
    rank counts as lost (default ``$KIMI_MLX_PEER_TIMEOUT``, else 20)."""
    global _active
    if group is None or group.size() == 1:
        return None
    if _active is None:
        _active = Watchdog(group, timeout)
    return _active


class _Peer:
    """One connection: to rank ``rank`` (rank 0's side) or to rank 0 (the others')."""

    def __init__(self, rank: int, host: str, sock: socket.socket):
        self.rank, self.host, self.sock = rank, host, sock
        self.buffer = b""
        self.last_seen = time.monotonic()
        self.leaving = False  # rank 0's side: said goodbye, to be answered
        self.gone = False  # left (or lost): no longer watched

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.host})"


class Watchdog:
    """Heartbeats between rank 0 and every other rank of ``group``; see the module docstring. Use ``watch``."""

    def __init__(self, group: mx.distributed.Group, timeout: Optional[float] = None):
        self.rank, self.size = group.rank(), group.size()
        self.timeout = _timeout(timeout)
        self.interval = min(1.0, self.timeout / 4)
        listener, address = None, None
        if self.rank == 0:
            host, port = _coordinator()
            try:
                listener = socket.create_server(("", port), backlog=self.size)
            except OSError as e:
                raise OSError(f"watchdog: rank 0 cannot listen on port {port} ({e}); set {COORDINATOR_ENV}=HOST:PORT "
                              "to a free port") from None
            address = f"{host}:{listener.getsockname()[1]}"
        mine = json.dumps({"host": socket.gethostname(), "address": address}).encode()
        infos = [json.loads(b) for b in gather_bytes(group, mine)]
        self.hosts = [info["host"] for info in infos]
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        if self.rank == 0:
            with listener:
                self.peers = self._accept(listener, address, deadline)
        else:
            self.peers = [self._connect(infos[0]["address"], deadline)]
        for peer in self.peers:
            peer.sock.setblocking(False)
            peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()  # sends come from the thread and from close()
        self._answered = threading.Event()  # rank 0 answered (or said) goodbye
        self._wake, self._waker = socket.socketpair()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kimi-mlx-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _accept(self, listener: socket.socket, address: str, deadline: float) -> list[_Peer]:
        peers: dict[int, _Peer] = {}
        while len(peers) < self.size - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                sock, _ = listener.accept()
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                rank = int(_read_line(sock).split()[1])  # "hello RANK"
            except (OSError, ValueError, IndexError) as e:
                missing = [r for r in range(1, self.size) if r not in peers]
                raise RuntimeError(f"watchdog: rank(s) {missing} did not connect to rank 0 at {address} within "
                                   f"{HANDSHAKE_SECONDS:g} s ({e}); set {COORDINATOR_ENV} to an address of rank 0 that "
                                   "every host can reach") from None
            peers[rank] = _Peer(rank, self.hosts[rank], sock)
        return [peers[r] for r in sorted(peers)]

    def _connect(self, address: str, deadline: float) -> _Peer:
        host, port = address.rsplit(":", 1)
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.01))
                sock.sendall(f"hello {self.rank}\n".encode())
                return _Peer(0, self.hosts[0], sock)
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"watchdog: rank {self.rank} cannot reach rank 0 at {address} ({e}); set "
                                       f"{COORDINATOR_ENV} to an address of rank 0 that every host can reach") from None
                time.sleep(0.1)

    # ---------------------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        next_beat = 0.0
        while True:
            open_peers = [p for p in self.peers if not p.gone]
            readable, _, _ = select.select([self._wake] + [p.sock for p in open_peers], [], [], self.interval)
            for peer in open_peers:
                if peer.sock in readable:
                    self._receive(peer)
            now = time.monotonic()
            for peer in open_peers:
                if not peer.leaving and now - peer.last_seen > self.timeout:
                    self._lost(peer, f"no heartbeat for {self.timeout:g} s ({TIMEOUT_ENV})")
            for peer in open_peers:
                if peer.leaving:  # answered only now: a loss seen in this round was told to it instead
                    self._send(peer, "ack")
                    peer.gone = True  # its socket stays open until close(): closing now could reset the answer
            if self._wake in readable:
                return
            if now >= next_beat:
                for peer in open_peers:
                    if not peer.gone:
                        self._send(peer, "beat")
                next_beat = now + self.interval

    def _receive(self, peer: _Peer) -> None:
        """Read and act on what ``peer`` sent."""
        try:
            data = peer.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if not peer.leaving:
                self._lost(peer, "its connection closed without a goodbye (process killed or crashed, or host down)")
            return
        peer.last_seen = time.monotonic()
        peer.buffer += data
        *lines, peer.buffer = peer.buffer.split(b"\n")
        for line in lines:
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "lost":  # from rank 0
                self._fatal(rest)
            elif word == "bye" and self.rank == 0:
                peer.leaving = True
            elif word in ("bye", "ack"):  # rank 0 left first, or answered our goodbye
                peer.gone = True
                self._answered.set()

    def _send(self, peer: _Peer, message: str) -> None:
        with self._lock:
            try:
                peer.sock.send(message.encode() + b"\n")
            except OSError:  # a full buffer or a closed peer: the receiving side tells which
                pass

    def _lost(self, peer: _Peer, why: str) -> None:
        peer.gone = True
        self._fatal(f"{peer} lost: {why}")

    def _fatal(self, text: str) -> None:
        """Print the error, tell the others (rank 0) and end the process, whatever fails on the way (a launcher
        killed with its ranks leaves stdout and stderr as pipes nobody reads: writing them raises)."""
        try:
            others = [p for p in self.peers if not p.gone] if self.rank == 0 else []
            for peer in others:
                self._send(peer, f"lost {text}")
            for write in (sys.stdout.flush, lambda: os.write(2, f"kimi-mlx: error: {text}\n".encode())):
                try:
                    write()
                except Exception:  # noqa: BLE001 - nowhere left to report it; the exit below is what matters
                    pass
            _drain([p.sock for p in others], time.monotonic() + DRAIN_SECONDS)
        finally:
            os._exit(EXIT_STATUS)

    # ------------------------------------------------------------------------------------------------ the end

    def close(self) -> None:
        """Say goodbye (at exit; also callable directly): ranks other than 0 wait for rank 0's answer, which is the
        error if a rank was lost meanwhile; the thread stops after a last look at every connection."""
        if self._closed:
            return
        self._closed = True
        if self.rank != 0 and not self.peers[0].gone:
            self._send(self.peers[0], "bye")
            self._answered.wait(self.timeout + 2 * self.interval)
        self._waker.send(b"x")
        self._thread.join(self.timeout)
        for peer in self.peers:
            if not peer.gone:
                self._send(peer, "bye")
            peer.sock.close()
        self._wake.close()
        self._waker.close()


def _drain(socks: list[socket.socket], deadline: float) -> None:
    """Read and drop what ``socks`` send until each closes or ``deadline`` (so closing them never resets a
    connection whose other end has not read our last message yet)."""
    for sock in list(socks):
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            socks.remove(sock)
    while socks and time.monotonic() < deadline:
        readable, _, _ = select.select(socks, [], [], max(deadline - time.monotonic(), 0))
        for sock in readable:
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                socks.remove(sock)


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            raise OSError("connection closed during the handshake")
        data += chunk
    return data.decode().strip()


def _timeout(timeout: Optional[float]) -> float:
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT))
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected seconds (a positive number)") from None
    if not timeout > 0:
        raise ValueError(f"watchdog timeout {timeout!r}: expected seconds (a positive number)")
    return float(timeout)


def _coordinator() -> tuple[str, int]:
    """(host, port) for rank 0 to listen on and the others to connect to; port 0: any free port."""
    given = os.environ.get(COORDINATOR_ENV)
    if given:
        host, _, port = given.rpartition(":") if ":" in given else (given, "", "0")
        if not port.isdigit():
            raise ValueError(f"{COORDINATOR_ENV}={given!r}: expected HOST or HOST:PORT")
        return host, int(port)
    if os.environ.get("MLX_JACCL_COORDINATOR"):
        return os.environ["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0], 0
    if os.environ.get("MLX_HOSTFILE"):
        first = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())[0]  # ring: [["ip:port", ...], ...]
        return (first[0] if isinstance(first, list) else first).rsplit(":", 1)[0], 0
    if os.environ.get("NCCL_HOST_IP"):
        return os.environ["NCCL_HOST_IP"], 0
    return socket.gethostname(), 0
