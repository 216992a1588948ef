"""A local TensorBoard process on a logdir, started and always stopped.

`start_tensorboard` runs ``python -m tensorboard.main --logdir DIR --host 127.0.0.1 --port N`` as a
child process and returns once its HTTP server answers. The `TensorBoardServer` it returns stops
the process on `stop`, at the end of a ``with`` block, when it is garbage-collected, and at
interpreter exit, so no TensorBoard is left behind.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Optional, Sequence

from ..errors import MonitoringError

__all__ = ["TensorBoardServer", "start_tensorboard"]

logger = logging.getLogger(__name__)

_PORT_IN_USE = "already in use"  # TensorBoard's message when its port is taken (tensorboard/program.py)
_POLL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it for a socket bound to port 0).

    TensorBoard has no ``--port 0``; another process could still take the port before
    TensorBoard binds it, which `start_tensorboard` answers by trying another.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _terminate(process: subprocess.Popen, log, timeout: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log.close()


class TensorBoardServer:
    """A running TensorBoard: ``url`` (``http://127.0.0.1:PORT/``), ``port``, ``pid``; `stop`
    terminates it and waits (kills it if it has not exited after ``timeout`` seconds)."""

    def __init__(self, process: subprocess.Popen, host: str, port: int, log):
        self._process = process
        self.host = host
        self.port = port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
        self._log = log
        # Stops the process if the server object is dropped without stop(), and at exit.
        self._finalizer = weakref.finalize(self, _terminate, process, log, 5.0)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Block until TensorBoard exits (or ``timeout`` seconds pass); its exit status, or None."""
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate TensorBoard and wait for it; safe to call more than once."""
        if self._finalizer.alive:
            self._finalizer.detach()
            _terminate(self._process, self._log, timeout)

    def __enter__(self) -> "TensorBoardServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"TensorBoardServer({self.url}, pid={self.pid}, {'running' if self.running else 'stopped'})"


# Straight to localhost: an http_proxy in the environment must not route the readiness check.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _answers(url: str) -> bool:
    try:
        with _DIRECT.open(url + "data/environment", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(log) -> str:
    log.seek(0)
    lines = [ln.strip() for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def start_tensorboard(
    logdir: "str | os.PathLike",
    host: str = "127.0.0.1",
    port: Optional[int] = None,
    timeout: float = 30.0,
    extra_args: Sequence[str] = (),
) -> TensorBoardServer:
    """Start TensorBoard on ``logdir`` and return once it answers HTTP (``/data/environment``).

    ``port=None`` picks a free one (and another if that one is taken meanwhile). Loads event files
    with TensorBoard's Python reader (``--load_fast=false``): one process, nothing else to stop.
    Starting takes a few seconds (importing TensorBoard). Raises `MonitoringError` with
    TensorBoard's last output line if it exits or does not answer within ``timeout`` seconds.
    """
    logdir = Path(logdir)
    if not logdir.is_dir():
        raise MonitoringError(f"logdir {str(logdir)!r} is not a directory; write a review there first")
    attempts = 0
    while True:
        attempts += 1
        chosen = free_port(host) if port is None else port
        command = [
            sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
            "--host", host, "--port", str(chosen), "--load_fast=false", *extra_args,
        ]
        log = tempfile.TemporaryFile()
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        server = TensorBoardServer(process, host, chosen, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not server.running:
                break
            if _answers(server.url):
                logger.info("TensorBoard %s on %s (pid %d)", server.url, logdir, server.pid)
                return server
            time.sleep(_POLL_S)
        status = process.poll()
        last = _tail(log)
        server.stop()
        if status is None:
            raise MonitoringError(f"TensorBoard did not answer on {server.url} within {timeout:g} s (last output: {last}); try a longer timeout")
        if not (_PORT_IN_USE in last and port is None and attempts < 3):
            raise MonitoringError(f"TensorBoard exited with status {status}: {last}")
