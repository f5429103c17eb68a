"""`ringserve serve --nnodes N --node-rank K` for K > 0: a host that serves no requests itself.

It runs what feeds its runner (start_node, actors/transport/topology.py: a relay-in from host 0
and the runner), prints their log lines on stderr (at --log-level), and serves an HTTP
`/health` for an orchestrator's probes (200 once its runner is ready, 503 before). It ends when host 0 stops (exit 0), or when anything here dies or host 0
is gone (exit 1): no partial recovery, the orchestrator restarts every host.
"""

from __future__ import annotations

import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def serve_node(server_args: dict[str, Any], stop: threading.Event) -> int:
    from ringserve.actors.server_args import ServerArgs
    from ringserve.actors.transport import messages as m
    from ringserve.actors.transport.memory import resolve_memory
    from ringserve.actors.transport.topology import start_node
    from ringserve.model.checkpoints.resolve import resolve_model

    args = ServerArgs.from_kwargs(**server_args)
    model_dir, tok_dir = resolve_model(args.model_path)
    args, _ = resolve_memory(args, model_dir)  # on many hosts: by need, the same number as host 0's
    # This host's only output: its actors' log lines (the runner's refusals, the relay's traffic)
    # on stderr at --log-level.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("ringserve")
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    ended: list[tuple[str, int | None]] = []
    done = threading.Event()

    def on_failure(name: str, code: int | None, text: str) -> None:
        ended.append((name, code))
        if code != 0:
            print(f"ringserve serve (node {args.node_rank}): {name} ended:\n{text}", file=sys.stderr, flush=True)
        done.set()

    state = {"ready": False}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            ok = self.path == "/health" and state["ready"] and not done.is_set()
            body = b"ok\n" if ok else b"not ready\n"
            self.send_response(200 if ok else (503 if self.path == "/health" else 404))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    health = ThreadingHTTPServer((args.host, args.port), Health)
    threading.Thread(target=health.serve_forever, name="health", daemon=True).start()
    print(f"ringserve serve (node {args.node_rank} of {args.nnodes}): /health on http://{args.host}:"
          f"{health.server_address[1]}; joining host 0 at {args.dist_init_addr}", file=sys.stderr, flush=True)  # fmt: skip
    group = start_node(args, m.encode(m.ActorConfig(args, str(model_dir), str(tok_dir))), on_failure)
    try:
        group.wait_ready(timeout=args.dist_timeout + 900)
        state["ready"] = True
        print(f"ringserve serve (node {args.node_rank}): ready", file=sys.stderr, flush=True)
        while not stop.is_set() and not done.wait(0.5):
            pass
    except Exception as e:  # noqa: BLE001 -- a failed start: the reason, exit 1
        print(f"ringserve serve (node {args.node_rank}): {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        group.shutdown()
        health.shutdown()
        health.server_close()
    if stop.is_set():
        return 0
    return 0 if ended and ended[0][1] == 0 else 1
