"""A throw-away PostgreSQL server for the tests: initdb and pg_ctl in a temporary folder, reached
only through a unix socket in that folder (no TCP port), stopped and deleted at the end.

PostgreSQL refuses to run as root, so under root (CI) the server runs as the unprivileged user
``nobody`` (through ``runuser``). `find_binaries` returns the reason when the Debian package
(``apt-get install -y postgresql``, which .ci/run does) is not installed, for a skip marker.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["find_binaries", "throwaway_postgres"]

_USER = "nobody"


def find_binaries() -> "tuple[Path | None, str]":
    """(the folder holding initdb and pg_ctl, "") or (None, why not)."""
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0, reverse=True):
        if all(os.access(Path(folder, tool), os.X_OK) for tool in ("initdb", "pg_ctl")):
            return Path(folder), ""
    on_path = shutil.which("initdb"), shutil.which("pg_ctl")
    if all(on_path):
        return Path(on_path[0]).parent, ""
    return None, "no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin or on PATH; apt-get install -y postgresql"


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    runuser = shutil.which("runuser")
    if runuser is None:
        raise RuntimeError("running as root and no runuser to start PostgreSQL as an unprivileged user")
    return [runuser, "-u", _USER, "--", *command]


@contextlib.contextmanager
def throwaway_postgres(port: int = 54329):
    """Yields an SQLAlchemy URL of a fresh, empty PostgreSQL database (trust authentication,
    unix socket only). Costs: initdb (~2-5 s) and a server start and stop (~1 s each)."""
    bin_dir, why = find_binaries()
    if bin_dir is None:
        raise RuntimeError(why)
    folder = Path(tempfile.mkdtemp(prefix="autoprec-pg-"))
    try:
        if os.geteuid() == 0:
            user = pwd.getpwnam(_USER)
            os.chown(folder, user.pw_uid, user.pw_gid)
        data = folder / "data"

        def run(*args):
            return subprocess.run(_as_server_user([str(a) for a in args]), check=True, capture_output=True, text=True, cwd=folder)

        run(bin_dir / "initdb", "-D", data, "-U", "autoprec", "--auth=trust", "--no-sync")
        # listen_addresses='' : no TCP at all; the socket lives in the temporary folder.
        options = f"-k {folder} -p {port} -c listen_addresses='' -c fsync=off"
        run(bin_dir / "pg_ctl", "-D", data, "-o", options, "-l", folder / "server.log", "-w", "start")
        try:
            yield f"postgresql+psycopg2://autoprec@/postgres?host={folder}&port={port}"
        finally:
            run(bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
