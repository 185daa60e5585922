"""The OpenAI gateway as a subprocess for tests and benches (`python -m k3backend openai`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3backend.tritonserver import free_port

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, headers: dict | None = None) -> int | None:
    """GET `url`: its status, or None when nothing answers."""
    try:
        with _DIRECT.open(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class Gateway:
    """`python -m k3backend openai --triton-url URL ...` on a free port, logging to `log_path`."""

    def __init__(self, triton_url: str, log_path: Path, *args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "K3_OPENAI_API_KEY": api_key or ""}
        cmd = [sys.executable, "-m", "k3backend", "openai", "--triton-url", triton_url, "--port", str(self.port), *args]
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while http_status(self.url + "/health") is None:  # listening: 200 or 503
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()
        return self.process.wait()
