"""docs/vllm.md's Run section, run as written: every fenced block of it is taken from the page and run in a fresh
directory (bash blocks with bash, the Python block saved as the file the page names), with this checkout's `afd`
first on PYTHONPATH. The served and offline tokens must equal `afd generate`'s, which must equal the output the page
shows; SIGTERM ends the server and the FFN ranks end on their own, with no error line. Skipped, with the reason,
where vLLM cannot be imported."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers.e2e import Leftovers

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm.md"
PORTS = (8000, 6239)  # the page's server and AFD world ports


def run_section() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of the Run section, in order."""
    text = DOC.read_text()
    section = text[text.index("## Run\n") : text.index("\n## ", text.index("## Run\n") + 1)]
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.S | re.M)


def block(blocks: list[tuple[str, str]], lang: str, marker: str) -> str:
    found = [body for kind, body in blocks if kind == lang and marker in body]
    assert len(found) == 1, f"docs/vllm.md: expected one {lang} block with {marker!r}, found {len(found)}"
    return found[0]


def tokens_in(line: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", line)]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def afd_errors(log: str) -> list[str]:
    """Lines that report a failure: tracebacks, ERROR records, an afd rank's `error:` or a cut forward pass. Not
    those of vLLM's API server process, which runs no afd code: its output handler races its own shutdown and
    sometimes logs EngineDeadError at a normal SIGTERM (docs/vllm.md, "Shutdown")."""
    bad = ("Traceback", " ERROR ", ": error: ", "in the middle of a forward pass")
    lines = [line for line in log.splitlines() if not line.startswith("(APIServer pid=")]
    return [line for line in lines if any(b in line for b in bad)]


@pytest.fixture(scope="module")
def vllm_installed() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to skip, said out loud
        pytest.skip(f"VLLM DOCS NOT TESTED: vLLM cannot be imported ({type(exc).__name__}: {exc})")


@pytest.mark.timeout(480)
def test_vllm_docs_run_as_written(vllm_installed, tmp_path) -> None:
    blocks = run_section()
    busy = [p for p in PORTS if not port_free(p)]
    assert not busy, f"ports {busy} that docs/vllm.md uses are taken on this host"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}

    def bash(script: str, timeout_s: float) -> str:
        done = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        assert done.returncode == 0, f"{script}\nexited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
        return done.stdout

    leftovers = Leftovers()
    groups: list[subprocess.Popen] = []
    try:
        bash(block(blocks, "bash", "afd export"), 60)

        # the server and its FFN ranks, in one shell; `afd generate`'s reference, then a request, from another
        log = tmp_path / "server.log"
        with open(log, "w") as sink:
            shell = subprocess.Popen(
                ["bash", "-c", block(blocks, "bash", "api_server")],
                cwd=tmp_path,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        groups.append(shell)
        deadline = time.monotonic() + 240
        reference = bash(block(blocks, "bash", "afd generate"), 60).strip()  # while the server starts
        shown = block(blocks, "", "->").strip()
        assert reference == shown, f"afd generate printed {reference!r}, the page shows {shown!r}"
        want = tokens_in(reference.split("->")[1])
        while "Application startup complete" not in log.read_text():
            assert shell.poll() is None and time.monotonic() < deadline, f"no server: {log.read_text()[-4000:]}"
            time.sleep(0.5)
        answer = json.loads(bash(block(blocks, "bash", "curl"), 120))
        assert answer["choices"][0]["token_ids"] == want

        started = [shell.pid, *children(shell.pid)]  # bash may run its last command in its own process
        (server,) = [p for p in started if "vllm.entrypoints.openai.api_server" in cmdline(p)]
        ffn = [p for p in started if "--role ffn" in cmdline(p)]
        assert len(ffn) == 2, [cmdline(p) for p in started]
        os.kill(server, signal.SIGTERM)
        shell.wait(60)
        assert not wait_gone(ffn, 30), "the FFN ranks did not end after the server"
        out = log.read_text()
        assert out.count("closing (cleanly)") == 1 and out.count("every attention rank shut down") == 2, out[-4000:]
        assert not afd_errors(out), "\n".join(afd_errors(out))

        # offline: the Python block as the file the page names, run by the page's command with FFN ranks of its own
        (tmp_path / "offline.py").write_text(block(blocks, "python", "LLM("))
        out = bash(block(blocks, "bash", "python offline.py"), 300)
        printed = [tokens_in(line) for line in out.splitlines() if re.fullmatch(r"\[[\d, ]+\]", line.strip())]
        assert printed == [want], out[-4000:]
        text = DOC.read_text()
        assert f"It prints the same tokens, `{want}`" in text, "the page's offline output is not the tokens printed"
        assert not wait_gone(leftovers.new_pids(), 30), "the offline FFN ranks did not end after vLLM"
        leftovers.check()
    finally:
        for group in groups:
            try:
                os.killpg(group.pid, signal.SIGKILL)  # the shell and everything it started (own session)
            except ProcessLookupError:
                pass
            group.wait(10)
        leftovers.cleanup()
