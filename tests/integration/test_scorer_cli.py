"""The real ``fastexp serve scorer|reward-server`` processes: refusing bad configuration, serving, stopping."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

FASTEXP = [sys.executable, "-m", "services.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(tmp_path: Path, section: str, body: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({section: body}))
    return path


@pytest.mark.parametrize("service,section", [("scorer", "scorer"), ("reward-server", "reward_server")])
def test_unknown_names_make_the_service_refuse_to_start_naming_them(tmp_path, service, section):
    config = _write(tmp_path, section, {"sources": [
        {"type": "rule", "name": "a", "function": "no_such_package.rules:check"},
        {"type": "rule", "name": "b", "function": "services.scorer.rules:no_such_rule"},
    ], "recipes": {"default": [["rule", "a", 1.0], ["rule", "b", 1.0]]}})
    done = subprocess.run([*FASTEXP, "serve", service, "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "refuses to start" in done.stderr
    assert "no_such_package" in done.stderr and "no_such_rule" in done.stderr


def test_a_recipe_naming_an_unknown_source_is_a_settings_error(tmp_path):
    config = _write(tmp_path, "scorer", {"recipes": {"default": [["model", "ghost", 1.0]]}})
    done = subprocess.run([*FASTEXP, "serve", "scorer", "--config", str(config)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "unknown source 'ghost'" in done.stderr


def test_a_missing_model_folder_refuses_to_start(tmp_path):
    config = _write(tmp_path, "reward_server", {"sources": [{"type": "model", "name": "rm", "path": "/no/rm"}]})
    done = subprocess.run([*FASTEXP, "serve", "reward-server", "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "rm: " in done.stderr and "/no/rm" in done.stderr


def test_reward_server_serves_and_stops_on_sigterm(tmp_path):
    port = _free_port()
    config = _write(tmp_path, "reward_server", {"sources": [
        {"type": "rule", "name": "math", "function": "services.scorer.rules:math_verify_reward", "workers": 1}]})
    process = subprocess.Popen([*FASTEXP, "serve", "reward-server", "--config", str(config), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "reward server did not come up"
            time.sleep(0.3)
        answer = httpx.post(f"http://127.0.0.1:{port}/get_reward", timeout=30,
                            json={"query": ["Q: 2+2? A: 4"], "prompts": ["Q: 2+2? A:"], "references": ["4"]})
        assert answer.json()["rewards"] == [1.0]
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
