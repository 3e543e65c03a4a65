#!/usr/bin/env python3
"""Run torch's own TCPStore server (torch 1.13 here) as a peer for tests.

Usage: /usr/bin/python3 torch_store_server.py [--host 127.0.0.1] [--port 0] [--duration S]

Starts TCPStore(host, port, world_size=None, is_master=True,
wait_for_workers=False): the master daemon with no `ADD init/` and no wait for
workers. Port 0 lets the kernel pick a free port, read back from `.port`
(supported by 1.13). Note that the 1.13 daemon binds the wildcard address
whatever --host says; --host is only where its own client connects and what is
printed. Prints `listening on HOST:PORT` (flushed) once serving, then stays up
until SIGTERM/SIGINT or --duration seconds, and exits 0.
"""
import argparse
import datetime
import signal
import sys
import threading

import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--duration", type=float, default=600.0)
    a = ap.parse_args()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    # The timeout bounds the server's own client connection to the daemon.
    store = dist.TCPStore(a.host, a.port, None, True, datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    print(f"listening on {a.host}:{store.port}", flush=True)
    stop.wait(a.duration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
