"""Locate, prepare and run a real tritonserver without Docker.

The PyPI wheel `nvidia-pytriton==0.7.0` ships tritonserver 2.51 (the release of NGC
`tritonserver:24.10-py3`), its libraries, the Python backend and one backend stub per CPython
version. This module turns that install into a running server:

- `find_tritonserver()` finds the pieces in the current environment;
- `prepare_backends()` builds a writable backend directory holding the stub for this Python;
- `server_env()` / `server_command()` give the environment and argv (`server_env` says why
  `LD_LIBRARY_PATH` needs the interpreter's LIBDIR and why the venv's `bin/` goes first on PATH);
- `TritonServer` runs one server for tests and tools; `serve_main()` execs one in the foreground.

Only the standard library is imported here, so tests and the CLI can use it cheaply.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install nvidia-pytriton==0.7.0 (or run scripts/setup-env)"
STUB_NAME = "triton_python_backend_stub"
# Readiness polls go straight to 127.0.0.1, whatever http_proxy says.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class TritonServerError(RuntimeError):
    """The server could not be found, prepared or started; the message carries the log tail."""


@dataclass(frozen=True)
class TritonInstall:
    """Paths of one tritonserver install (the pytriton wheel layout)."""

    binary: Path  # pytriton/tritonserver/bin/tritonserver
    libs_dir: Path  # site-packages/nvidia_pytriton.libs
    backends_dir: Path  # pytriton/tritonserver/backends (read-only template)
    stub: Path  # python_backend_stubs/<3.X>/triton_python_backend_stub for this interpreter


def find_tritonserver() -> TritonInstall:
    """Find the tritonserver shipped by nvidia-pytriton in the running environment."""
    spec = importlib.util.find_spec("pytriton")  # does not import pytriton itself
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError(
            f"tritonserver not found: package 'pytriton' is not installed for {sys.executable}; "
            f"{INSTALL_HINT}"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        binary=root / "bin" / "tritonserver",
        libs_dir=root.parent.parent / "nvidia_pytriton.libs",
        backends_dir=root / "backends",
        stub=root / "python_backend_stubs" / version / STUB_NAME,
    )
    for name, path in vars(install).items():
        if not path.exists():
            if name == "stub":
                have = sorted(p.name for p in (root / "python_backend_stubs").glob("3.*"))
                raise TritonServerError(
                    f"no Python backend stub for Python {version} in {path.parent.parent} "
                    f"(have {', '.join(have) or 'none'})"
                )
            raise TritonServerError(
                f"tritonserver install incomplete: {name} missing at {path}; {INSTALL_HINT}"
            )
    return install


def prepare_backends(dest: Path, install: TritonInstall | None = None) -> Path:
    """Copy `backends/` into `dest/backends` with this Python's stub in `backends/python/`.

    The Python backend runs `<backend-directory>/python/triton_python_backend_stub`, and the
    wheel keeps one stub per CPython version elsewhere, so the server needs an assembled copy.
    Files already equal in size and mtime are left alone, which makes a repeated call cheap;
    copies go through a temporary name and `os.replace`, so concurrent callers do not see
    half-written files. Returns the directory to pass as `--backend-directory`.
    """
    install = install or find_tritonserver()
    backends = Path(dest) / "backends"
    for src in install.backends_dir.rglob("*"):
        if src.is_file() and "__pycache__" not in src.parts:
            _copy_if_changed(src, backends / src.relative_to(install.backends_dir))
    _copy_if_changed(install.stub, backends / "python" / STUB_NAME)
    return backends


def _copy_if_changed(src: Path, dst: Path) -> None:
    s = src.stat()
    with contextlib.suppress(FileNotFoundError):
        d = dst.stat()
        if d.st_size == s.st_size and int(d.st_mtime) == int(s.st_mtime):
            return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and the stubs it spawns.

    - `LD_LIBRARY_PATH` = the wheel's libs + this interpreter's LIBDIR: without LIBDIR the stub
      can load Debian's older libpython3.11 instead of ours and models fail to start.
    - `PATH` starts with this environment's `bin/`: the embedded interpreter in the stub finds
      its prefix (and so the venv's site-packages, numpy<2, torch, k3backend) through it.
    """
    env = dict(os.environ if base is None else base)
    libdirs = [str(install.libs_dir)]
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        libdirs.append(libdir)
    env["LD_LIBRARY_PATH"] = _prepend(libdirs, env.get("LD_LIBRARY_PATH", ""))
    env["PATH"] = _prepend([str(Path(sys.executable).parent)], env.get("PATH", ""))
    return env


def _prepend(entries: list[str], existing: str) -> str:
    rest = [p for p in existing.split(os.pathsep) if p and p not in entries]
    return os.pathsep.join(entries + rest)


# Without a GPU the wheel's GPU build of tritonserver still probes for one at start: DCGM and NVML
# for GPU metrics ("Error: Failed to initialize NVML", "DCGM unable to start") and cudaHostAlloc
# for the pinned-memory pool ("Unable to allocate pinned system memory"). These flags skip both;
# nothing is lost, since neither can work without a GPU.
NO_GPU_ARGS = ("--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0")
SHM_DIR = Path("/dev/shm")  # where the Python backend's stub regions live (POSIX shared memory on Linux)
SHM_PREFIX_OPTION = "shm-region-prefix-name"


def gpu_visible(env: Mapping[str, str] | None = None) -> bool:
    """Whether tritonserver will find an NVIDIA GPU: the driver lists one and CUDA_VISIBLE_DEVICES
    does not hide them all. Reads /proc and /dev only, so it costs nothing and imports nothing."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-1")):
        return False
    return any(Path("/proc/driver/nvidia/gpus").glob("*")) or any(Path("/dev").glob("nvidia[0-9]*"))


def server_command(
    model_repository: Path,
    backend_dir: Path,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    extra_args: Sequence[str] = (),
    install: TritonInstall | None = None,
    gpu: bool | None = None,
    address: str | None = None,
) -> list[str]:
    """argv for tritonserver; `extra_args` come last, so they can override the defaults.

    gpu: whether a GPU is visible (None: `gpu_visible()`); without one `NO_GPU_ARGS` are added.
    address: bind the three endpoints to this address only (tests: 127.0.0.1); None: Triton's 0.0.0.0.
    """
    install = install or find_tritonserver()
    gpu = gpu_visible() if gpu is None else gpu
    bind = () if address is None else tuple(f"--{e}-address={address}" for e in ("http", "grpc", "metrics"))
    return [
        str(install.binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={Path(backend_dir).resolve()}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        *bind,
        *(() if gpu else NO_GPU_ARGS),
        *extra_args,
    ]


def _metrics_allowed(args: Sequence[str]) -> bool:
    """Whether tritonserver serves metrics with these arguments (the last `--allow-metrics` wins, as
    `--allow-metrics=false` or `--allow-metrics false`)."""
    allowed = True
    for i, a in enumerate(args):
        if a == "--allow-metrics" and i + 1 < len(args):
            a = f"{a}={args[i + 1]}"
        if a.startswith("--allow-metrics="):
            allowed = a.split("=", 1)[1].strip().lower() not in ("false", "0", "no", "off")
    return allowed


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it; a race with others is possible)."""
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    # All sockets stay open until every port is picked, so the n ports are distinct.
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("", 0))  # tritonserver binds 0.0.0.0
        return [s.getsockname()[1] for s in socks]


class TritonServer:
    """One tritonserver process: start, wait until ready, stop. Use as a context manager.

    The server runs in its own process group (so `stop()` can sweep the Python-backend stubs
    too), listens on `address` only (loopback by default: tests and tools talk to it from this
    host) and logs to `work_dir/tritonserver.log`. Ports left as None are picked with
    `free_port()`. Stopping it can take up to `--exit-timeout-secs` (default 30) while a client
    still holds an HTTP keep-alive connection: close clients first.
    """

    def __init__(
        self,
        model_repository: Path,
        work_dir: Path,
        *,
        models: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        startup_timeout_s: float = 300.0,
        install: TritonInstall | None = None,
        address: str = "127.0.0.1",
    ) -> None:
        self.model_repository = Path(model_repository)
        self.work_dir = Path(work_dir)
        self.models = tuple(models)
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.address = address
        self.install = install or find_tritonserver()
        self.log_path = self.work_dir / "tritonserver.log"
        self._fixed_ports = (http_port, grpc_port, metrics_port)
        self.http_port = self.grpc_port = self.metrics_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._sigterm_sent = False
        # Our own stub-region prefix, so that `stop` can remove what a killed server leaves in /dev/shm
        # (a killed or stuck stub's region stays); None where extra_args name their own.
        own = any(SHM_PREFIX_OPTION in a for a in self.extra_args)
        self.shm_prefix = None if own else f"k3backend_{uuid.uuid4().hex[:12]}_"

    # URLs in the forms the clients take: tritonclient.grpc wants host:port without a scheme.
    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> TritonServer:
        """Start the server and block until it (or every model in `models`) is ready."""
        if self.process is not None:
            raise TritonServerError(f"server already started (pid {self.process.pid})")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        backend_dir = prepare_backends(self.work_dir, self.install)
        # A port picked here can be taken before the server binds it; then try new ones.
        attempts = 1 if any(self._fixed_ports) else 3
        for attempt in range(1, attempts + 1):
            picked = iter(_free_ports(3))
            self.http_port, self.grpc_port, self.metrics_port = (
                p or next(picked) for p in self._fixed_ports
            )
            self._spawn(backend_dir)
            try:
                self._wait_ready()
                return self
            except TritonServerError as e:
                self.stop()
                if attempt == attempts or "already in use" not in self.log_tail(40):
                    raise TritonServerError(f"{e}\n{self.failure_report()}") from None
                logger.warning("tritonserver: a port was taken before it started, retrying with new ports")
                self.process = None
        raise AssertionError("unreachable")

    def _spawn(self, backend_dir: Path) -> None:
        shm = () if self.shm_prefix is None else (f"--backend-config=python,{SHM_PREFIX_OPTION}={self.shm_prefix}",)
        cmd = server_command(
            self.model_repository, backend_dir, self.http_port, self.grpc_port, self.metrics_port,
            (*shm, *self.extra_args), self.install, address=self.address,
        )
        self._log_file = open(self.log_path, "wb")
        self._log_file.write(f"$ {' '.join(cmd)}\n".encode())
        self._log_file.flush()
        self._sigterm_sent = False
        self.process = subprocess.Popen(
            cmd, env=server_env(self.install), stdin=subprocess.DEVNULL, stdout=self._log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        atexit.register(self.stop)
        logger.info(
            "tritonserver pid %d: http %s grpc %s metrics %s log %s",
            self.process.pid, self.http_url, self.grpc_url, self.metrics_url, self.log_path,
        )

    def _wait_ready(self) -> None:
        """Until the models (or the server) are ready and the metrics endpoint answers: Triton starts
        its metrics service after HTTP, ~40 ms later on a CPU, so a scrape right after readiness could
        be refused."""
        urls = [self.http_url + p for p in ([f"/v2/models/{m}/ready" for m in self.models] or ["/v2/health/ready"])]
        if _metrics_allowed(self.extra_args):
            urls.append(self.metrics_url)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise TritonServerError(f"tritonserver exited with code {code} during startup")
            if all(self._http_status(u) == 200 for u in urls):
                return
            if time.monotonic() > deadline:
                raise TritonServerError(
                    f"tritonserver not ready after {self.startup_timeout_s:.0f} s "
                    f"(waiting for {', '.join(self.models) or 'server readiness'})"
                )
            time.sleep(0.25)

    def _http_status(self, url: str) -> int | None:
        try:
            with _DIRECT.open(url, timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return None

    def begin_stop(self) -> None:
        """SIGTERM the server without waiting (stop several at once, then `stop` each)."""
        if self.process is not None and self.process.poll() is None and not self._sigterm_sent:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            self._sigterm_sent = True

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the server (once), wait `timeout_s`, then SIGKILL its whole process group.

        The group is swept even after a clean exit, so no stub outlives the server, and so are the
        stub regions a killed server leaves in /dev/shm. Idempotent; returns the server's exit code
        (None if it was never started).
        """
        atexit.unregister(self.stop)
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.begin_stop()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tritonserver pid %d: no exit %.0f s after SIGTERM, killing", self.pid, timeout_s)
        self._kill_group()
        code = self.process.wait()
        for region in self.shm_regions():  # the group is dead: nothing attaches to these any more
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def shm_regions(self) -> list[Path]:
        """The stub shared-memory regions of this server that exist now (none known: [])."""
        return sorted(SHM_DIR.glob(self.shm_prefix + "*")) if self.shm_prefix and SHM_DIR.is_dir() else []

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self._log_lines()[-lines:])

    def failure_report(self, lines: int = 40) -> str:
        """Triton's error lines (E<date> ...), then the log tail: at start-up the tail is mostly
        the options table, and the cause (a model's initialize traceback) is further up."""
        log = self._log_lines()
        errors = [line for line in log if re.match(r"E\d{4} ", line)][-20:]
        return (
            f"--- error lines of {self.log_path} ---\n" + "\n".join(errors or ["(none)"])
            + f"\n--- last {lines} lines ---\n" + "\n".join(log[-lines:])
        )

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ["(no log)"]


# ---------------------------------------------------------------------------------------------
# CLI: `k3backend serve` / `python -m k3backend.tritonserver`


def default_model_repository() -> Path:
    """`model_repository/` of the source checkout this module lives in, else of the cwd."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "model_repository").is_dir():
        return checkout / "model_repository"
    return Path.cwd() / "model_repository"


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Run tritonserver in the foreground (this process is replaced by it).

    Options not listed here go to tritonserver unchanged, e.g.
    `--model-control-mode=explicit --load-model=k3_ensemble --exit-timeout-secs=30`.
    With `--openai` this process stays, runs tritonserver and the OpenAI gateway side by side
    and stops both together (k3backend.supervise).
    """
    cmd, env, urls = serve_command(argv)
    gateway = openai_command(argv)
    # This is the CLI's user-facing output, printed before the process becomes tritonserver.
    for line in urls if gateway is None else [*urls, gateway[2]]:
        print(line, flush=True)
    print(f"$ {' '.join(cmd)}", flush=True)
    if gateway is None:
        os.execve(cmd[0], cmd, env)
        return 0  # not reached
    from k3backend.supervise import Child, run_together

    print(f"$ {' '.join(gateway[0])}", flush=True)
    return run_together([Child("tritonserver", cmd, env), Child("openai gateway", gateway[0], gateway[1])])


def _serve_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="k3backend serve",
        description="Run tritonserver on the k3backend model repository. "
        "Unknown options are passed to tritonserver.",
    )
    parser.add_argument("--model-repository", type=Path, default=default_model_repository())
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--address", default="127.0.0.1",
        help="address the HTTP, gRPC and metrics endpoints bind (default %(default)s: this host only; "
        "0.0.0.0 for every interface, behind a reverse proxy)",
    )
    parser.add_argument(
        "--backend-root", type=Path, default=Path(sys.prefix) / "var" / "k3backend-tritonserver",
        help="writable directory that receives backends/ with this Python's stub "
        "(default: %(default)s)",
    )
    parser.add_argument("--openai", action="store_true",
                        help="also run the OpenAI API gateway (docs/openai.md); its options follow")
    if "--openai" in (sys.argv[1:] if argv is None else argv):
        from k3backend.openai.options import add_options

        add_options(parser, prefix="openai-")
    args, extra = parser.parse_known_args(argv)
    return parser, args, extra


def serve_command(argv: Sequence[str] | None = None) -> tuple[list[str], dict[str, str], list[str]]:
    """`k3backend serve`'s argv, environment and the URL lines it prints; exits on bad options."""
    parser, args, extra = _serve_args(argv)
    if not args.model_repository.is_dir():
        parser.error(f"--model-repository: {args.model_repository} is not a directory")
    try:
        install = find_tritonserver()
        backend_dir = prepare_backends(args.backend_root, install)
    except TritonServerError as e:
        parser.exit(2, f"k3backend serve: {e}\n")
    cmd = server_command(
        args.model_repository, backend_dir, args.http_port, args.grpc_port, args.metrics_port,
        extra, install, address=args.address,
    )
    host = "localhost" if args.address in ("127.0.0.1", "0.0.0.0") else args.address
    urls = [f"HTTP    http://{host}:{args.http_port}", f"gRPC    {host}:{args.grpc_port}",
            f"metrics http://{host}:{args.metrics_port}/metrics"]
    return cmd, server_env(install), urls


def openai_command(argv: Sequence[str] | None = None) -> tuple[list[str], dict[str, str], str] | None:
    """The gateway's argv, environment and URL line for `serve --openai`, else None. The API key
    travels in the environment, not on the command line, where `ps` would show it."""
    _, args, _ = _serve_args(argv)
    if not args.openai:
        return None
    from k3backend.openai.options import API_KEY_ENV, api_key, gateway_argv

    grpc_host = "127.0.0.1" if args.address == "0.0.0.0" else args.address
    cmd = [sys.executable, "-m", "k3backend", "openai",
           *gateway_argv(args, f"{grpc_host}:{args.grpc_port}", prefix="openai-")]
    env = dict(os.environ)
    key = api_key(args)
    if key:
        env[API_KEY_ENV] = key
    host = "localhost" if args.openai_host in ("127.0.0.1", "0.0.0.0") else args.openai_host
    return cmd, env, f"OpenAI  http://{host}:{args.openai_port}/v1"


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
