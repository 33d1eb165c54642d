"""A throwaway JupyterLab for the browser tests.

The project is copied to a scratch folder first (without .venv, .git and build outputs), and the
server runs there, so JupyterLab's autosave and anything a lesson writes never touch the checkout.
The kernel is the project's own Python, so `labkit` still imports from the checkout (editable
install): the lessons exercise the working tree as it is. Settings, workspaces and runtime files
live in the scratch folder too, so the tests neither read nor change the user's JupyterLab setup.
"""
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Not copied: the environment, history and build outputs (large, and not what a lesson reads).
SKIP = (".venv", ".git", "build", "site", "student", "__pycache__", ".ipynb_checkpoints",
        ".pytest_cache", "*.egg-info")

# JupyterLab user settings for the run: every cell rendered at once (so every widget can be
# checked), per-cell timing recorded, no news/update toast over the widgets, no autosave.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "recordTiming": True},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
}


def free_port():
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """JupyterLab on 127.0.0.1:<free port>, serving a scratch copy of the project."""

    def __init__(self, log_path):
        self.scratch = Path(tempfile.mkdtemp(prefix="labkit-browser-"))
        self.project = self.scratch / "project"
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.process = None

    def start(self, timeout_s=120):
        shutil.copytree(ROOT, self.project, ignore=shutil.ignore_patterns(*SKIP))
        settings = self.scratch / "settings"
        for plugin, values in SETTINGS.items():
            path = settings / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(self.scratch / "config"),
                   JUPYTER_RUNTIME_DIR=str(self.scratch / "runtime"))
        command = [
            sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip", "127.0.0.1",
            "--port", str(self.port), f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.project}", "--ServerApp.port_retries=0",
            "--expose-app-in-browser",                     # window.jupyterapp, read by the tests
            f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={self.scratch / 'workspaces'}",
            "--allow-root",                                # CI containers often run as root
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=self.project, env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited early; see {self.log_path}")
            try:
                self.api("status")
                return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer in {timeout_s} s; see {self.log_path}")

    def api(self, path, method="GET"):
        """One call of the server's REST API; the decoded JSON answer (None if empty)."""
        request = urllib.request.Request(f"{self.base}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            body = answer.read()
        return json.loads(body) if body else None

    def lab_url(self, notebook, workspace):
        """The URL that opens `notebook` (relative to the project) in a fresh workspace."""
        return (f"{self.base}/lab/workspaces/{workspace}/tree/{notebook}"
                f"?reset&token={self.token}")

    def shut_down_kernels(self):
        """End every session and its kernel, so kernels do not pile up on a small machine."""
        for session in self.api("sessions") or []:
            self.api(f"sessions/{session['id']}", method="DELETE")

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            try:
                self.shut_down_kernels()
            except OSError:
                pass
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)
