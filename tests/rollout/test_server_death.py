"""A server that dies while answering (SGLang's process ending on a CUDA out-of-memory error when it takes its KV
cache back) closes the connection a moment before its process exits: the error must still say that it died and show
the end of its log, not a bare "Connection aborted"."""

from __future__ import annotations

import socket
import sys
import textwrap

import pytest

from megarl.rollout.sglang_server import SGLangError, SGLangServer

# /health and /freeze_gc answer; /resume_memory_occupation logs an OOM, drops the connection, exits 1 s later
DYING = textwrap.dedent("""
    import http.server, os, sys, threading, time

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_GET(self):
            self.answer()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/resume_memory_occupation":
                return self.answer()
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB", flush=True)
            self.connection.shutdown(2)
            threading.Thread(target=lambda: (time.sleep(1.0), os._exit(1))).start()

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_dying_mid_request_is_named_with_its_log(tmp_path):
    port = free_port()
    server = SGLangServer([sys.executable, "-c", DYING, str(port)], port, log_path=str(tmp_path / "server.log"),
                          startup_timeout=30).start()
    try:
        with pytest.raises(SGLangError, match="(?s)/resume_memory_occupation .* failed: .*server died.*"
                                              "CUDA out of memory"):
            server.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
    finally:
        server.shutdown()
