"""`ringserve serve`: start the engine once and serve its IPC socket and HTTP until SIGINT/SIGTERM.

    ringserve serve --model smollm2 [--socket PATH] [--host H --port P] [--api-key K] [server flags]

On a signal it stops accepting, aborts what runs (callers get finish reason abort), and leaves
no shared memory or socket file behind. When an actor dies the engine's supervisor starts the
actors again and every request in flight goes on (actors/frontend/supervisor.py). Exit status:
0 after a signal, 1 if the engine died (a crash loop, or any crash with --no-supervise).

Many hosts: every host runs the same command but `--node-rank` (`--nnodes N --dist-init-addr
HOST0:PORT --dist-token T`); host 0 serves, the others run only a runner (actors/cli/node.py).
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys
import threading
import time


def parser() -> argparse.ArgumentParser:
    from ringserve.actors.server_args import ServerArgs

    ap = argparse.ArgumentParser(prog="ringserve serve", description="serve a model over the IPC socket and HTTP")
    ap.add_argument("--model", "--model-path", dest="model_path", default=None,
                    help="'tiny', 'smollm2', a model directory or a .gguf file (default: smollm2)")  # fmt: skip
    ap.add_argument("--socket", default=None, help="IPC socket path (default: engine.sock in a private 0700 directory)")
    ap.add_argument("--no-socket", action="store_true", help="serve HTTP only (default: the IPC socket too)")
    ap.add_argument("--no-http", action="store_true", help="serve the IPC socket only (default: HTTP too)")
    ap.add_argument("--api-key", default=None,
                    help="HTTP clients must send 'Authorization: Bearer <key>' (default: none needed)")  # fmt: skip
    ServerArgs.add_cli_args(ap, skip=("model_path",))
    return ap


def _import_servers() -> None:
    import uvicorn  # noqa: F401

    import ringserve.actors.frontend.server  # noqa: F401


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP port, bound now, before the model loads (minutes for a large one): a port in use
    is a ValueError saying so at once, not a traceback after the load. uvicorn serves on it."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    reuse_port=False)  # fmt: skip
    except OSError as e:
        what = "in use" if e.errno == errno.EADDRINUSE else f"not available ({e.strerror})"
        raise ValueError(f"--host {host} --port {port}: the address is {what}; stop what holds it or pass another "
                         f"--port (0: any free port)") from None  # fmt: skip


def main(argv: list[str]) -> int:
    from ringserve.actors.server_args import ServerArgs
    from ringserve.actors.server_options import OPTIONS
    from ringserve.actors.transport.cleanup import remove_stale

    args = parser().parse_args(argv)
    server_args = {k: v for k, v in vars(args).items() if k in OPTIONS}
    stop = threading.Event()
    checked = ServerArgs(**server_args)  # a bad option is refused before anything starts
    removed, _ = remove_stale()  # a killed server's shared memory (`ringserve cleanup`)
    if removed:
        print(f"ringserve serve: removed {removed} shared-memory segments left by dead ringserve processes",
              file=sys.stderr, flush=True)  # fmt: skip

    def on_signal(signum: int, _frame: object) -> None:
        print(f"\nringserve serve: {signal.Signals(signum).name}, shutting down", file=sys.stderr, flush=True)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if server_args.get("node_rank", 0) > 0:  # another host of a multi-host engine: a runner only
        from ringserve.actors.cli.node import serve_node

        try:
            return serve_node(server_args, stop)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    from ringserve.actors.frontend.engine import Engine
    from ringserve.model.checkpoints.resolve import resolve_model

    listener = None if args.no_http else bind_http(checked.host, checked.port)
    try:
        resolve_model(checked.model_path)  # a model that is not there is told before anything starts
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    t0 = time.perf_counter()
    # the HTTP stack (fastapi, uvicorn: ~0.6 s of imports) loads while the engine starts
    importing = threading.Thread(target=_import_servers, name="ringserve-import", daemon=True)
    importing.start()
    print("ringserve serve: loading the model and compiling its step programs ...", file=sys.stderr, flush=True)
    try:
        engine = Engine(**server_args)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    importing.join()
    from ringserve.actors.frontend.server import Servers

    servers = None
    died = False
    try:
        if stop.is_set():
            return 0
        servers = Servers(engine, socket=args.socket, ipc=not args.no_socket, http=not args.no_http,
                          api_key=args.api_key, listener=listener).start()  # fmt: skip
        _banner(engine, servers, time.perf_counter() - t0)
        while not stop.wait(0.5):
            if engine.frontend.dead is not None:
                print(f"ringserve serve: the engine died: {engine.frontend.dead}", file=sys.stderr, flush=True)
                died = True
                break
    finally:
        if servers is not None:
            servers.stop()
        engine.shutdown()
        for s, h in previous.items():
            signal.signal(s, h)
        print("ringserve serve: stopped", file=sys.stderr, flush=True)
    return 1 if died else 0


def _banner(engine, servers, seconds: float) -> None:
    r = engine.runner_info
    a = engine.args
    pending = a.precompile and a.background_compile and (r.get("programs_total") or 0) > (r.get("num_programs") or 0)
    lines = [
        f"ringserve serve: ready in {seconds:.1f} s",
        f"  model      {engine.served_model_name} ({engine.model_dir}; {r.get('family')}, {r.get('num_layers')} layers, {a.dtype})",
        f"  devices    {len(r.get('devices', []))} x {r.get('platform')} {r.get('devices')} (tp_size {a.tp_size}, attention {r.get('attention_backend')})",
        f"  compiled   {r.get('num_programs')} of {r.get('programs_total')} step programs (load + compile "
        f"{r.get('load_and_compile_s')} s){'; the rest compile in the background' if pending else ''}",
        f"  KV pool    {engine.kv_pool.summary()}; pages of {a.page_size}; {a.max_running_requests} running requests "
        f"of up to {a.context_length} tokens",
    ]
    if servers.socket_path:
        lines.append(f"  socket     {servers.socket_path}   (from ringserve import Client; Client(path))")
    if servers.url:
        key = " (API key required)" if servers.api_key else ""
        lines.append(f"  HTTP       {servers.url}{key}   (OpenAI: /v1, SGLang: /generate, Prometheus: /metrics)")
    if a.restartable:
        lines.append(f"  supervisor a dead actor is restarted and its requests go on (up to {a.max_restarts} "
                     f"restarts in {a.restart_window_s:g} s; --no-supervise: it ends the server)")  # fmt: skip
    lines.append("  Ctrl-C or SIGTERM stops it.")
    print("\n".join(lines), flush=True)
