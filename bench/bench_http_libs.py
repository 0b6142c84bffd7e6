"""Which HTTP library serves the endpoint: tornado (installed with ipykernel) against starlette + uvicorn.

Each server runs as the endpoint must run inside a kernel: on its own thread with its own event
loop, text chunks pushed into it from another thread. Measured per library: import time, a
small JSON GET (sequential, keep-alive), and a 64-chunk server-sent-event stream (time to the
first chunk and to the end). Starlette and uvicorn are not shardbook dependencies; put them on
the path to compare:

    pip install --target /tmp/httplibs starlette uvicorn
    PYTHONPATH=/tmp/httplibs OMP_NUM_THREADS=1 .venv/bin/python bench/bench_http_libs.py
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import statistics
import subprocess
import sys
import threading
import time

NUM_GETS = 300
NUM_CHUNKS = 64
NUM_STREAMS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def produce(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> None:
    """A worker thread handing chunks to the server's loop, as the ranks' stream does."""
    for i in range(NUM_CHUNKS):
        loop.call_soon_threadsafe(q.put_nowait, f"tok{i} ")
    loop.call_soon_threadsafe(q.put_nowait, None)


def start_tornado(port: int) -> None:
    import tornado.web

    class Health(tornado.web.RequestHandler):
        def get(self):
            self.write({"status": "ok"})

    class Stream(tornado.web.RequestHandler):
        async def get(self):
            self.set_header("Content-Type", "text/event-stream")
            q: asyncio.Queue = asyncio.Queue()
            threading.Thread(target=produce, args=(asyncio.get_running_loop(), q)).start()
            while (chunk := await q.get()) is not None:
                self.write(f"data: {chunk}\n\n")
                await self.flush()

    async def main():
        tornado.web.Application([("/health", Health), ("/stream", Stream)]).listen(port, "127.0.0.1")
        await asyncio.Event().wait()

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()


def start_starlette(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def stream(request):
        async def events():
            q: asyncio.Queue = asyncio.Queue()
            threading.Thread(target=produce, args=(asyncio.get_running_loop(), q)).start()
            while (chunk := await q.get()) is not None:
                yield f"data: {chunk}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/stream", stream)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.install_signal_handlers = lambda: None  # not the main thread
    threading.Thread(target=server.run, daemon=True).start()


def wait_up(port: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"no server on port {port}")


def measure(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    gets = []
    for _ in range(NUM_GETS):
        t = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        gets.append(time.perf_counter() - t)
    firsts, totals = [], []
    for _ in range(NUM_STREAMS):
        t = time.perf_counter()
        conn.request("GET", "/stream")
        response = conn.getresponse()
        response.readline()
        firsts.append(time.perf_counter() - t)
        response.read()
        totals.append(time.perf_counter() - t)
    return {
        "get_ms": statistics.median(gets) * 1e3,
        "first_ms": statistics.median(firsts) * 1e3,
        "stream_ms": statistics.median(totals) * 1e3,
    }


def import_ms(modules: str) -> float:
    code = f"import time; t = time.perf_counter(); import {modules}; print((time.perf_counter() - t) * 1e3)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    libraries = {"tornado": (start_tornado, "tornado.web")}
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        libraries["starlette+uvicorn"] = (start_starlette, "uvicorn, starlette.applications, starlette.responses")
    except ImportError:
        print("starlette/uvicorn not importable: measuring tornado alone (see the docstring)")
    results = {}
    for name, (start, modules) in libraries.items():
        port = free_port()
        start(port)
        wait_up(port)
        results[name] = {"import_ms": import_ms(modules), **measure(port)}
    print(f"{'library':<20}{'import ms':>10}{'GET ms':>9}{'SSE first ms':>14}{'SSE 64 chunks ms':>18}")
    for name, r in results.items():
        print(f"{name:<20}{r['import_ms']:>10.1f}{r['get_ms']:>9.2f}{r['first_ms']:>14.2f}{r['stream_ms']:>18.2f}")
    if len(results) == 2:
        t, s = results["tornado"], results["starlette+uvicorn"]
        print("ratios tornado / starlette+uvicorn: " + ", ".join(f"{k} {t[k] / s[k]:.2f}" for k in t))


if __name__ == "__main__":
    main()
