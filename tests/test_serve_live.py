"""`transformer serve` as users run it: a real uvicorn process on 127.0.0.1, driven by Chromium and by a load test.

The browser test needs Debian's `chromium` (`make install` installs it when run as root). Without it the test skips,
unless TRANSFORMER_NMT_REQUIRE_BROWSER=1 (set by `.ci/run`), where it fails: CI must run it.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'transformer-nmt[serve]'")

from .conftest import MULTI30K  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "Ein Mann fährt mit dem Fahrrad durch die Stadt."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(trained_run, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`transformer serve` on a free port, answering /health; (process, URL)."""
    port = _free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "transformer", "serve", "--checkpoint",
                                    str(trained_run / "checkpoints" / "best.pt"), "--port", str(port),
                                    "--threads", "1", "--no-access-log", *flags],
                                   stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return process, url


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    """`transformer serve` on a free port; yields its URL."""
    process, url = _start(trained_run, tmp_path_factory.mktemp("serve") / "server.log")
    yield url
    process.terminate()
    process.wait(30)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    message = "Debian's chromium is not installed (apt-get install -y chromium; `make install` does it as root)"
    if os.environ.get("TRANSFORMER_NMT_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _heatmap(page) -> list[list[float]]:
    return page.eval_on_selector_all(
        "#heatmap tbody tr", "rows => rows.map(r => [...r.querySelectorAll('td.cell')].map(td => +td.dataset.weight))")


def _close(a: list[list[float]], b: list[list[float]], tol: float = 1e-6) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(abs(u - v) <= tol for u, v in zip(x, y))
                                    for x, y in zip(a, b))


def test_the_attention_explorer_in_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = _chromium()
    beam_size = httpx.get(server + "/health", timeout=60).json()["decoding"]["beam_size"]  # the page's default
    expected = httpx.post(server + "/attention", json={"text": SENTENCE, "beam_size": beam_size}, timeout=60).json()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1100})
            page.goto(server + "/")
            page.wait_for_function("document.getElementById('model-info').textContent.includes('de → en')")
            page.fill("#source", SENTENCE)
            page.click("#translate")
            page.wait_for_selector("#heatmap td.cell")

            assert page.inner_text("#translations li").strip() == expected["translation"]
            # the default view: cross-attention of the last layer, head 0; one cell per (target, source) piece
            weights = _heatmap(page)
            assert len(weights) == len(expected["tgt_out_pieces"])
            assert all(len(row) == len(expected["src_pieces"]) for row in weights)
            assert all(abs(sum(row) - 1) < 1e-4 for row in weights)
            assert _close(weights, expected["cross"][-1][0])
            assert page.eval_on_selector_all("#heatmap th.row", "e => e.map(x => x.textContent)") == \
                expected["tgt_out_pieces"]

            page.select_option("#layer", "0")
            page.select_option("#head", "1")
            changed = _heatmap(page)
            assert changed != weights
            assert _close(changed, expected["cross"][0][1])

            # hovering a target piece shades each source piece by the weight it gets
            page.hover('#heatmap th.row[data-index="1"]')
            shaded = page.eval_on_selector_all("#key-pieces .piece", "e => e.map(x => +x.dataset.highlight)")
            assert shaded == pytest.approx(expected["cross"][0][1][1], abs=1e-6)

            page.select_option("#head", "mean")
            mean = _heatmap(page)
            heads = expected["cross"][0]
            assert mean[0] == pytest.approx([sum(h[0][k] for h in heads) / len(heads)
                                             for k in range(len(heads[0][0]))], abs=1e-6)

            page.select_option("#kind", "encoder_self")
            assert len(_heatmap(page)) == len(expected["src_pieces"]) == len(_heatmap(page)[0])
            page.select_option("#kind", "cross")
            page.screenshot(path=str(tmp_path / "explorer.png"), full_page=True)
            assert (tmp_path / "explorer.png").stat().st_size > 10_000

            page.fill("#n-best", "9")  # more than the beam: the server's refusal is shown, nothing breaks
            page.click("#translate")
            page.wait_for_selector("#error:not([hidden])")
            assert "n_best" in page.inner_text("#error")
        finally:
            browser.close()


def test_load_8_clients_160_requests_no_errors_nothing_lost_or_reordered(server, tmp_path):
    source = MULTI30K / "test_2016_flickr.de.gz"
    if not source.is_file():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    figures_file = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "load_test_serve.py"), "--url", server,
                          "--source", str(source), "--sentences", "60", "--clients", "8", "--requests", "160",
                          "--json", str(figures_file)], capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(figures_file.read_text())
    assert figures["requests"] == 160 and figures["errors"] == figures["lost"] == figures["mismatched"] == 0
    assert figures["sentences"] == figures["sentences_sent"] > 160
    # batching works: requests average 2.5 sentences, the decoding calls under load took several requests each
    assert figures["mean_batch_sentences"] > 5, figures


def test_a_port_in_use_is_one_line_before_the_model_loads(trained_run, capsys, monkeypatch):
    from transformer.cli import main
    from transformer.serve import server as server_module

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(server_module.Translator, "from_checkpoint", not_loaded)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--checkpoint", str(trained_run / "checkpoints" / "best.pt"), "--port", str(port)]) == 2
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _translate_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data)) + data


def _long_request(lines: int = 128) -> dict:
    """A request that keeps the decoding thread busy for a while (wide beams over the longest test sentences)."""
    source = gzip.open(MULTI30K / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().split("\n")[:500]
    return {"text": sorted(source, key=len)[-lines:], "beam_size": 16, "min_len": 100, "max_len_a": 0.0,
            "max_len_b": 110}


def _read_answer(connection: socket.socket) -> bytes:
    """Everything the server sends on `connection` until it closes it (a reset counts as closed)."""
    answer = b""
    while True:
        try:
            chunk = connection.recv(10000)
        except ConnectionResetError:
            return answer
        if not chunk:
            return answer
        answer += chunk


def _read_one_answer(connection: socket.socket) -> bytes:
    """One whole answer (headers and a Content-Length body) from a connection that stays open."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += connection.recv(10000)
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    while len(body) < int(headers[b"content-length"]):
        body += connection.recv(10000)
    return head + b"\r\n\r\n" + body


def test_a_malformed_request_gets_the_json_error_form(server):
    """h11 cannot parse these: the answer is the JSON of every refusal, not uvicorn's plain text."""
    for head, words in ((b"Content-Length: abc\r\n", "Content-Length"), (b"Content-Length: 5\r\nContent-Length: 6\r\n",
                                                                          "Content-Length"),
                        (b"no colon here\r\n", "header")):
        with _raw(server) as connection:
            connection.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
            answer = _read_answer(connection).decode()
        status, _, rest = answer.partition("\r\n")
        headers, _, body = rest.partition("\r\n\r\n")
        assert status == "HTTP/1.1 400 Bad Request", answer
        assert "content-type: application/json" in headers.lower() and "connection: close" in headers.lower()
        error = json.loads(body)
        assert error["field"] == "headers" and words in error["error"], error
        assert error["errors"] == [{"field": "headers", "message": error["error"]}]
    assert httpx.get(server + "/health", timeout=10).status_code == 200  # still serving


def test_slow_and_departed_clients(trained_run, tmp_path):
    """A client that stalls its headers is disconnected, one that stalls its body gets 408, both within
    --request-timeout; a client that leaves while its request waits gets nothing decoded for it, and one that leaves
    during its own decoding call stops it at its next batch of sentences."""
    process, url = _start(trained_run, tmp_path / "server.log", "--request-timeout", "1")
    try:
        start = time.monotonic()
        with _raw(url) as stalled:
            stalled.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            assert stalled.recv(1000) == b""  # closed by the server
        assert time.monotonic() - start < 4
        start = time.monotonic()
        with _raw(url) as slow:
            slow.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"text\": ")
            answer = b""
            while b"}" not in answer.rpartition(b"\r\n\r\n")[2]:  # headers, then the JSON body
                chunk = slow.recv(10000)
                if not chunk:
                    break
                answer += chunk
            answer = answer.decode()
        assert time.monotonic() - start < 4
        assert answer.startswith("HTTP/1.1 408") and '"field":"body"' in answer and "--request-timeout" in answer
        # A long request (4 batches of 32 sentences) busies the decoding thread and a second one waits behind it;
        # the second one's client leaves, then the first one's, during the first batch.
        with httpx.Client(timeout=300) as client:
            before = client.get(url + "/health").json()["batching"]
            with _raw(url) as long_one:
                long_one.sendall(_translate_request(_long_request()))
                time.sleep(1.0)  # decoding
                with _raw(url) as waiting:
                    waiting.sendall(_translate_request({"text": ["Ein Hund läuft über die Wiese."] * 7}))
                    time.sleep(1.0)  # read and queued
                left = time.monotonic()
            assert client.get(url + "/health").json()["batching"]["batches"] == before["batches"], \
                "the long request ended before the test could leave: make it longer"
            deadline = time.monotonic() + 120  # the long call stops after its first batch, then the other is dropped
            while True:
                after = client.get(url + "/health").json()["batching"]
                if after["abandoned_requests"] > before["abandoned_requests"] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            stopped_after = time.monotonic() - left
            answer = client.post(url + "/translate", json={"text": [SENTENCE]})  # the decoding thread is free
        assert answer.status_code == 200
        assert after["cancelled_requests"] - before["cancelled_requests"] == 1, (before, after)
        assert after["abandoned_requests"] - before["abandoned_requests"] == 1, (before, after)
        assert after["sentences"] == before["sentences"] and after["batches"] == before["batches"]  # neither served
        print(f"the departed request's decoding call stopped {stopped_after:.1f} s after its client left")
    finally:
        process.terminate()
        process.wait(30)


def test_sigterm_finishes_the_request_in_flight_refuses_new_ones_and_exits_0(trained_run, tmp_path):
    """On SIGTERM the request in flight is answered in full, new connections are refused, and connections with
    nothing in flight (one idle after an answer, one whose body stalls) are closed at once, not after the drain
    deadline or the request timeout (both 60 s here); then the process exits with status 0."""
    process, url = _start(trained_run, tmp_path / "server.log", "--shutdown-timeout", "60", "--request-timeout", "60")
    request = _long_request(64)
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(1) as pool, _raw(url) as idle, _raw(url) as stalled:
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_one_answer(idle).startswith(b"HTTP/1.1 200")  # kept alive after it (5 s, uvicorn's default)
        stalled.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"text\": ")
        in_flight = pool.submit(client.post, url + "/translate", json=request)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # the listening socket is closed at once
            httpx.get(url + "/health", timeout=5)
        for connection in (idle, stalled):
            connection.settimeout(3)
            assert _read_answer(connection) == b""  # closed without an answer
        assert time.monotonic() - signalled < 3
        assert not in_flight.done(), "the request in flight ended before the test could check: make it longer"
        answer = in_flight.result()
        answered = time.monotonic()
    assert answer.status_code == 200 and len(answer.json()["translations"]) == 64
    assert process.wait(60) == 0, (tmp_path / "server.log").read_text()[-2000:]
    assert time.monotonic() - answered < 10  # nothing else held the process


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_during_the_drain_ends_the_server_at_once(trained_run, tmp_path, second):
    """The first SIGTERM starts the drain of the request in flight; a second SIGTERM or Ctrl-C ends the process at
    once (status 130), without waiting for the decoding call."""
    process, url = _start(trained_run, tmp_path / "server.log", "--shutdown-timeout", "60")
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(client.post, url + "/translate", json=_long_request(128))
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert process.poll() is None and not in_flight.done()  # draining: the request is still decoded
        process.send_signal(second)
        signalled = time.monotonic()
        assert process.wait(30) == 130, (tmp_path / "server.log").read_text()[-2000:]
        assert time.monotonic() - signalled < 5
        try:  # cut off: the connection closed, or an error answer sent as the tasks were cancelled
            assert in_flight.result().status_code != 200
        except httpx.HTTPError:
            pass
    assert "stopped at once" in (tmp_path / "server.log").read_text()
