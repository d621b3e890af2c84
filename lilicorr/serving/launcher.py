"""Start and stop a real Triton Inference Server for a generated model repository.

Two binaries are supported, chosen by `find_tritonserver()`:

* ``wheel``: the ``tritonserver`` 2.51 shipped inside the ``nvidia-pytriton`` wheel (CPU machines, CI).
  Its Python backend needs a backend directory made of *symlinks* (copies break the bundled
  ``$ORIGIN`` RPATH) holding ``libtriton_python.so``, ``triton_python_backend_utils.py`` and the
  stub built for the running interpreter's Python version (``python_backend_stubs/3.X/``).
* ``system``: a ``tritonserver`` found on PATH (NGC images); it keeps its own backend directory.

How the stub process finds our virtual environment (verified, see tests/test_serving.py):
the stub embeds libpython and, like any embedded interpreter, computes ``sys.prefix`` by looking
for ``python3`` on PATH and reading the ``pyvenv.cfg`` next to it; PYTHONPATH is ignored. So the
server is started with the running interpreter's ``bin/`` first on PATH (the venv's ``python3``)
and ``LD_LIBRARY_PATH`` starting with ``sysconfig LIBDIR`` (the libpython the stub must load).
A server started by hand from a shell needs the same: the venv activated (its ``bin/`` first on
PATH) and that ``LD_LIBRARY_PATH``.

Control endpoints are closed: the model-repository, shared-memory, logging and trace APIs answer
only requests carrying the header ``admin-key: <key>`` (HTTP) or the metadata
``triton-grpc-protocol-admin-key: <key>`` (gRPC) (Triton's ``--http-restricted-api`` /
``--grpc-restricted-protocol``). The key is the operator's
``admin_key`` or, by default, a random per-launch secret that only this launcher uses (to drain).
tritonserver takes the key only as a command-line option, so once the server has parsed its options
(its first threads start about 0.1 s after exec) the launcher overwrites the key in the server's
argv with ``*`` (`hide_option_value`, through ``/proc/PID/mem``, which a parent may write): from
then on ``ps`` and ``/proc/PID/cmdline`` show ``admin-key=****``. Where that is refused (no
``/proc``, a hardened kernel) it warns that the key stays visible to local users. Start-up checks
that the server accepts the key, so a server that read its options late fails loudly.

Shutdown (`TritonServer.stop`) drains: it writes ``protocol.SHUTDOWN_FILE`` with a deadline into
each model directory (the ``lilicorr`` model then refuses new requests and ends running ones at the
deadline with finish_reason "shutdown"), unloads the ensembles (Triton refuses new ensemble
requests and waits for the running ones), then every other model, and only then sends SIGTERM;
after ``--exit-timeout-secs`` and a margin the server's process group (the stubs are in it) is
SIGKILLed. The server never outlives its launcher: it gets a parent-death signal (SIGKILL,
``prctl(PR_SET_PDEATHSIG)``: when the *thread* that started it exits, so start it from a thread
that lives as long as the server), and a small reaper process kills its process group and removes
its shared memory and temp folder when the launcher dies without stopping it. Shared-memory
regions and temp folders carry the launcher's pid; those of dead launchers are removed at start.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Sequence

SHM_BASE_PREFIX = "triton_python_backend_shm_region_"
TMP_PREFIX = "lilicorr-triton-"
REPO_TMP_PREFIX = "lilicorr-repo-"   # deploy/serve.py's temporary model repository (+ "<pid>-")
ADMIN_HEADER = "admin-key"                                 # HTTP header
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER  # gRPC metadata key (Triton adds the prefix)
# APIs that only requests with the admin header may use (Triton's restricted-API categories)
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
SHUTDOWN_FILE = "shutdown.json"      # == protocol.SHUTDOWN_FILE (launcher stays import-free)
PR_SET_PDEATHSIG = 1


class ServerStartError(RuntimeError):
    """The server exited or did not become ready; the message carries the log tail."""


@dataclasses.dataclass(frozen=True)
class ServerBinary:
    path: Path
    kind: str                    # "wheel" | "system"
    wheel_root: Path | None = None   # .../pytriton/tritonserver for kind == "wheel"


def _wheel_root() -> Path | None:
    import importlib.util
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        root = Path(loc) / "tritonserver"
        if (root / "bin" / "tritonserver").exists():
            return root
    return None


def find_tritonserver(prefer: str = "auto") -> ServerBinary:
    """Locate a tritonserver binary. prefer: "auto" (wheel, then PATH), "wheel" or "system".

    The environment variable LILICORR_TRITONSERVER=/path/to/tritonserver overrides both.
    """
    override = os.environ.get("LILICORR_TRITONSERVER")
    if override:
        return ServerBinary(Path(override), "system")
    root = _wheel_root() if prefer in ("auto", "wheel") else None
    if root is not None:
        return ServerBinary(root / "bin" / "tritonserver", "wheel", root)
    if prefer in ("auto", "system"):
        found = shutil.which("tritonserver")
        if found:
            return ServerBinary(Path(found), "system")
        for cand in ("/opt/tritonserver/bin/tritonserver",):
            if os.access(cand, os.X_OK):
                return ServerBinary(Path(cand), "system")
    raise FileNotFoundError(
        "no tritonserver found: install the serve extra (`pip install -e .[serve]`, which brings "
        "nvidia-pytriton's bundled server) or run inside an NGC tritonserver image")


def python_version_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def make_backend_dir(dest: str | os.PathLike, binary: ServerBinary) -> Path:
    """Create ``dest/python/`` with symlinks to the wheel's Python backend and the matching stub.

    Returns ``dest`` (to pass as --backend-directory). Only for the wheel's server.
    """
    if binary.kind != "wheel" or binary.wheel_root is None:
        raise ValueError("make_backend_dir only applies to the nvidia-pytriton wheel's server")
    src_backend = binary.wheel_root / "backends" / "python"
    stub = binary.wheel_root / "python_backend_stubs" / python_version_tag() / "triton_python_backend_stub"
    if not stub.exists():
        raise FileNotFoundError(f"the wheel ships no Python backend stub for Python {python_version_tag()} ({stub})")
    dest = Path(dest)
    pydir = dest / "python"
    pydir.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": src_backend / "libtriton_python.so",
        "triton_python_backend_utils.py": src_backend / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    for name, target in links.items():
        link = pydir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(target.resolve(), link)
    return dest


def venv_root() -> Path | None:
    """The running interpreter's virtual environment (None for a bare interpreter)."""
    if sys.prefix != getattr(sys, "base_prefix", sys.prefix) and (Path(sys.prefix) / "bin" / "activate").exists():
        return Path(sys.prefix)
    return None


def python_bin_dir() -> Path:
    """Folder whose ``python3`` the stub must find first on PATH: the venv's bin, else the interpreter's."""
    root = venv_root()
    if root is not None:
        return root / "bin"
    return Path(sys.executable).parent


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so its Python stubs run the current interpreter and venv."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ld = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != libdir]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([libdir] + ld) if libdir else os.pathsep.join(ld)
    bindir = str(python_bin_dir())
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir]
    env["PATH"] = os.pathsep.join([bindir] + path)
    env.pop("PYTHONHOME", None)       # would override the prefix computed from PATH
    root = venv_root()
    if root is not None:
        env["VIRTUAL_ENV"] = str(root)
    # every stub's thread pools follow the engine's policy (engine_threads); callers may override
    env.setdefault("OMP_NUM_THREADS", str(engine_threads()))
    return env


MAX_ENGINE_THREADS = 8     # a small model's step stops scaling well before this many threads


def engine_threads() -> int:
    """CPU threads of the served engine (torch, ONNX Runtime) and of every stub's pools when
    nothing sets them (num_threads 0 in the model config, no OMP_NUM_THREADS): every core this
    process may run on but one, which tritonserver's own threads (gRPC, the stubs' IPC) need, at
    most MAX_ENGINE_THREADS. On 2 cores the engine at 2 threads through Triton measured 0.6-0.7x
    its speed at 1 thread (results/peers_cpu.md); offline, without a server beside it, 2 threads
    were faster."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                        # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores - 1, MAX_ENGINE_THREADS))


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_ports(n: int, host: str) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    return ports


def leftover_shm(prefix: str = SHM_BASE_PREFIX) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/{prefix}*"))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_leftovers() -> list[str]:
    """Shared-memory regions and temp folders of launchers that died without cleaning up (their
    names carry the launcher's pid); returns what was removed."""
    removed = []
    shm_re = f"{SHM_BASE_PREFIX}lilicorr_"
    for path in leftover_shm(shm_re):
        pid = Path(path).name[len(shm_re):].split("_", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    for prefix in (TMP_PREFIX, REPO_TMP_PREFIX):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*")):
            pid = Path(path).name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def port_in_use(host: str, port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                          socket.SOCK_STREAM)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):     # not Linux/glibc: the reaper alone cleans up
        return None


_PRCTL = _find_prctl()     # resolved here: the child of a fork must not dlopen


def _die_with_parent(parent: int) -> None:
    """preexec_fn of tritonserver: SIGKILL when the launching thread dies (Linux prctl)."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:      # the launcher died before prctl took effect
        os._exit(1)


# The reaper: a tiny process in its own session that outlives a launcher killed without stop():
# it waits for EOF on stdin (the launcher's end of the pipe closes when the launcher dies) and, unless
# the launcher said "done" first, kills the server's process group and removes its leftovers.
REAPER = r"""
import glob, os, shutil, signal, sys, time
pgid, shm_prefix, workdirs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
data = sys.stdin.read()
if "done" in data:
    sys.exit(0)
def members():
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = open(stat).read()
        except OSError:
            continue
        f = text[text.rfind(")") + 2:].split()
        if len(f) > 2 and f[0] != "Z" and int(f[2]) == pgid:
            out.append(int(stat.split("/")[2]))
    return out
deadline = time.monotonic() + 10
while members() and time.monotonic() < deadline:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        break
    time.sleep(0.1)
for path in glob.glob("/dev/shm/" + shm_prefix + "*"):
    try:
        os.unlink(path)
    except OSError:
        pass
for workdir in workdirs:
    shutil.rmtree(workdir, ignore_errors=True)
"""


def live_group_members(pgid: int) -> list[int]:
    """Pids of non-zombie processes in process group `pgid` (Linux /proc)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(stat.split("/")[2]))
    return out


def hide_option_value(proc: subprocess.Popen, prefix: str, value: str, timeout: float = 30.0) -> bool:
    """Overwrite `value` with '*' wherever `prefix + value` occurs in `proc`'s argv (what ``ps`` and
    ``/proc/PID/cmdline`` show), once the process has parsed its options: tritonserver parses them
    first thing in main() and starts its first thread right after. Returns whether it did (False:
    the process exited, never started a thread within `timeout`, or /proc refused the write)."""
    task, deadline = Path(f"/proc/{proc.pid}/task"), time.monotonic() + timeout
    needle = (prefix + value).encode()
    try:
        while len(os.listdir(task)) < 2:              # still one thread: options maybe unparsed
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        text = Path(f"/proc/{proc.pid}/stat").read_text()
        fields = text[text.rfind(")") + 2:].split()
        start, end = int(fields[45]), int(fields[46])    # arg_start, arg_end (proc(5) fields 48, 49)
        with open(f"/proc/{proc.pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            args = mem.read(end - start)
            i = args.find(needle)
            while i >= 0:
                mem.seek(start + i + len(prefix))
                mem.write(b"*" * len(value.encode()))
                i = args.find(needle, i + len(needle))
        return True
    except (OSError, ValueError, IndexError):
        return False


class TritonServer:
    """Context manager around one tritonserver process.

    >>> with TritonServer("repo/") as srv:
    ...     client = LiLiCorrClient(srv.grpc_url)

    Ports default to free loopback ports. ``log_file=None`` captures the server log into the
    launcher's temp folder (``srv.log_path``); pass ``log_file="-"`` to inherit stdout/stderr.
    """

    def __init__(self, model_repository: str | os.PathLike, *, host: str = "127.0.0.1",
                 grpc_port: int | None = None, http_port: int | None = None,
                 metrics_port: int | None = None, binary: ServerBinary | None = None,
                 log_file: str | os.PathLike | None = None, log_verbose: int = 0,
                 startup_timeout: float = 180.0, exit_timeout: int = 10,
                 stub_timeout: int = 120, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, models: Sequence[str] | None = None,
                 admin_key: str | None = None, drain_timeout: float = 30.0,
                 cleanup_paths: Sequence[str | os.PathLike] = ()):
        self.model_repository = Path(model_repository).resolve()
        # operators' key for the control APIs; without one a per-launch secret only we know
        self.admin_key = admin_key or secrets.token_urlsafe(24)
        self.admin_key_given = bool(admin_key)
        self.drain_timeout = drain_timeout
        self.cleanup_paths = [str(p) for p in cleanup_paths]   # the reaper removes these too
        self.host = host
        self.binary = binary or find_tritonserver()
        self._ports = (grpc_port, http_port, metrics_port)
        self.log_file = log_file
        self.log_verbose = log_verbose
        self.startup_timeout = startup_timeout
        self.exit_timeout = exit_timeout
        self.stub_timeout = stub_timeout
        self.extra_args = list(extra_args)
        self.models = list(models) if models else None
        self._env = env
        self.proc: subprocess.Popen | None = None
        self.workdir: Path | None = None
        self.shm_prefix = f"{SHM_BASE_PREFIX}lilicorr_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.grpc_port = self.http_port = self.metrics_port = 0
        self.log_path: Path | None = None
        self.last_log = ""
        self.abort: "threading.Event | None" = None    # set it to give up waiting for readiness
        self._log_fh = None
        self._reaper: subprocess.Popen | None = None
        self.killed = False        # stop() had to SIGKILL a server that did not exit by itself
        self.admin_key_hidden = False   # the key in tritonserver's argv was overwritten after parsing

    # ------------------------------------------------------------------ urls
    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        assert self.workdir is not None
        cmd = [str(self.binary.path), f"--model-repository={self.model_repository}"]
        if self.binary.kind == "wheel":
            backend_dir = make_backend_dir(self.workdir / "backends", self.binary)
            cmd.append(f"--backend-directory={backend_dir}")
        cmd += [
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=true",
            "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--backend-config=python,stub-timeout-seconds={self.stub_timeout}",
            f"--log-verbose={self.log_verbose}",
            # control APIs only with the admin header (stop() uses it to drain)
            f"--http-restricted-api={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
        ]
        # explicit mode: stop() drains ensembles through the (restricted) repository API before SIGTERM
        cmd.append("--model-control-mode=explicit")
        cmd += [f"--load-model={m}" for m in (self.models or ["*"])]
        return cmd + self.extra_args

    def start(self) -> "TritonServer":
        """Start and wait until ready. Auto-chosen ports that another process grabbed in the
        meantime ("already in use") are re-picked, up to three attempts."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        if not is_loopback(self.host) and not self.admin_key_given:
            print(f"WARNING: tritonserver will listen on {self.host}, beyond loopback, without an admin key: "
                  "inference is open to the network (the control APIs stay closed; pass an admin key to "
                  "use them, and put an authenticating proxy in front for anything else)",
                  file=sys.stderr, flush=True)
        remove_stale_leftovers()
        for name, port in zip(("grpc", "http", "metrics"), self._ports):
            if port and port_in_use(self.host, port):
                raise ServerStartError(
                    f"{name} port {port} on {self.host} is already in use (another server, or one left "
                    "running by a launcher that was killed?); stop it or choose another port")
        for f in self.model_repository.glob(f"*/{SHUTDOWN_FILE}"):   # a previous run's drain
            f.unlink()
        auto_ports = not all(self._ports)
        for attempt in range(3):
            try:
                return self._start_once()
            except ServerStartError as e:
                if not (auto_ports and "already in use" in str(e)) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self) -> "TritonServer":
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
        g, h, m = self._ports
        auto = _free_ports(3, self.host)
        self.grpc_port, self.http_port, self.metrics_port = g or auto[0], h or auto[1], m or auto[2]
        if self.log_file == "-":
            stdout = None
        else:
            self.log_path = Path(self.log_file) if self.log_file else self.workdir / "tritonserver.log"
            self._log_fh = open(self.log_path, "ab")
            stdout = self._log_fh
        env = server_env(self._env)
        # cwd = our temp folder: the stub puts '' first on sys.path, so a repo checkout as cwd
        # would mask whether the venv's (editable) install is really what the stub imports
        parent = os.getpid()
        self.proc = subprocess.Popen(self.command(), cwd=self.workdir, env=env, stdout=stdout,
                                     stderr=subprocess.STDOUT if stdout else None,
                                     start_new_session=True, preexec_fn=lambda: _die_with_parent(parent))
        self._reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(self.proc.pid), self.shm_prefix,
                                         str(self.workdir), *self.cleanup_paths],
                                        stdin=subprocess.PIPE, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.admin_key_hidden = hide_option_value(self.proc, f"{ADMIN_HEADER}=", self.admin_key)
            if not self.admin_key_hidden and self.admin_key_given and self.proc.poll() is None:
                print("WARNING: could not hide the admin key in tritonserver's command line: local users "
                      "who can read /proc can see it", file=sys.stderr, flush=True)
            self.wait_ready()
            status, body = self._http_post("/v2/repository/index", {}, timeout=10.0, admin=True)
            if status != 200:
                raise ServerStartError(f"tritonserver refused the admin key ({status}: {body[:200]})")
        except BaseException:
            self.stop()
            raise
        return self

    def _http_status(self, path: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
            return 0

    def is_live(self) -> bool:
        return self._http_status("/v2/health/live") == 200

    def is_ready(self) -> bool:
        return self._http_status("/v2/health/ready") == 200

    def wait_ready(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerStartError(f"tritonserver exited with code {self.proc.returncode if self.proc else None}"
                                       f"\n{self.log_tail()}")
            if self.is_ready():
                return
            if self.abort is not None and self.abort.is_set():
                raise ServerStartError("aborted while waiting for the server to become ready")
            time.sleep(0.25)
        raise ServerStartError(f"tritonserver not ready after {timeout or self.startup_timeout:.0f} s\n{self.log_tail()}")

    def log_text(self) -> str:
        if self.log_path is not None and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return self.last_log

    def log_tail(self, n: int = 60) -> str:
        text = self.log_text()
        if not text:
            return "(server log not captured)"
        return "\n".join(text.splitlines()[-n:])

    def _http_post(self, path: str, body: dict | None = None, timeout: float = 10.0,
                   admin: bool = False) -> tuple[int, str]:
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json"}
        if admin:
            headers[ADMIN_HEADER] = self.admin_key
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, socket.timeout, OSError) as e:
            return 0, str(e)

    def ensemble_models(self) -> list[str]:
        out = []
        for cfg in sorted(self.model_repository.glob("*/config.pbtxt")):
            text = cfg.read_text(errors="replace")
            if 'platform: "ensemble"' in text or "platform:\"ensemble\"" in text.replace(" ", ""):
                out.append(cfg.parent.name)
        return out

    def model_states(self) -> dict[str, str] | None:
        """{model: state} from the (restricted) repository index; None when it cannot be read."""
        status, body = self._http_post("/v2/repository/index", {}, timeout=5.0, admin=True)
        if status != 200:
            return None
        try:
            return {e.get("name"): e.get("state", "") for e in json.loads(body)}
        except ValueError:
            return None

    def engine_busy(self) -> bool | None:
        """Whether the lilicorr engine holds active or waiting requests (its /metrics gauges);
        None when the metrics cannot be read."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5.0) as r:
                text = r.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
            return None
        busy, seen = 0.0, False
        for line in text.splitlines():
            if line.startswith("lilicorr_requests{"):
                seen = True
                busy += float(line.rsplit(None, 1)[-1])
        return busy > 0 if seen else None

    def _unload(self, names: Sequence[str], deadline: float, idle_grace: float = 3.0) -> bool:
        """Unload `names` and wait until they are gone, at most until `deadline`, or until the
        engine has been idle for `idle_grace` s while they still are not (tritonserver 2.51 keeps
        a model referenced while any client holds a gRPC stream open on it)."""
        for m in names:
            self._http_post(f"/v2/repository/models/{m}/unload", timeout=5.0, admin=True)
        idle_since = None
        while time.monotonic() < deadline:
            states = self.model_states()
            if states is None:
                return False
            if all(states.get(m, "UNAVAILABLE") not in ("READY", "UNLOADING", "LOADING") for m in names):
                return True
            if self.engine_busy() is not True:     # idle, or the engine model is gone already
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > idle_grace:
                    return False
            else:
                idle_since = None
            time.sleep(0.1)
        return False

    def begin_shutdown(self, drain_timeout: float | None = None) -> float:
        """Write the shutdown file (wall-clock deadline) into every model directory; returns the
        deadline as time.monotonic()."""
        wait = self.drain_timeout if drain_timeout is None else drain_timeout
        doc = json.dumps({"deadline": time.time() + wait})
        for cfg in self.model_repository.glob("*/config.pbtxt"):
            with contextlib.suppress(OSError):
                (cfg.parent / SHUTDOWN_FILE).write_text(doc)
        return time.monotonic() + wait

    def drain(self, timeout: float | None = None) -> bool:
        """Graceful shutdown before SIGTERM: announce the drain deadline to the models, unload the
        ensembles (Triton refuses new ensemble requests and waits for the running ones, which the
        engine ends by the deadline), then unload every other model. True when all unloaded.

        Why not SIGTERM alone: tritonserver 2.51 then refuses the internal requests an ensemble
        makes for its next step, so a streaming ensemble request can never finish.
        """
        if self.proc is None or self.proc.poll() is not None:
            return True
        deadline = self.begin_shutdown(timeout)
        grace = 5.0                          # the final responses still pass through postprocessing
        ok = self._unload(self.ensemble_models(), deadline + grace)
        states = self.model_states() or {}
        rest = [m for m, st in states.items() if st in ("READY", "LOADING")]
        return self._unload(rest, max(deadline, time.monotonic()) + grace) and ok

    def stop(self, timeout: float | None = None, drain_timeout: float | None = None) -> int | None:
        """Drain (see `drain`; ``drain_timeout`` defaults to the constructor's), SIGTERM, wait (exit
        timeout + margin), SIGKILL the process group; remove our shared-memory regions and temp
        dirs. Returns tritonserver's exit code (0: it exited cleanly)."""
        rc = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.drain(drain_timeout)
            except Exception:  # noqa: BLE001 - draining is best effort; SIGTERM follows anyway
                pass
        if self.proc is not None:
            # past its exit timeout the server either exited or hangs on a client that keeps a
            # gRPC stream open (2.51 waits for open calls); a few seconds more, then SIGKILL
            wait = timeout if timeout is not None else self.exit_timeout + 5
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(wait)
                except subprocess.TimeoutExpired:
                    self.killed = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
            rc = self.proc.returncode
            # stubs left behind by a killed server share its process group
            if live_group_members(self.proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while live_group_members(self.proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
            self.proc = None
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        for path in leftover_shm(self.shm_prefix):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self._reaper is not None:        # nothing left to reap: tell it so and let it go
            with contextlib.suppress(OSError, ValueError):
                self._reaper.stdin.write(b"done\n")
                self._reaper.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(10)
            self._reaper = None
        if self.workdir is not None:
            if self.log_path is not None and self.log_path.parent == self.workdir:
                # the temp dir goes away: keep the log text readable (log_text / log_tail)
                try:
                    self.last_log = self.log_path.read_text(errors="replace")
                except OSError:
                    self.last_log = ""
                self.log_path = None
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        return rc

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
