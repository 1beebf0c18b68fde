"""A web server for the cluster tests, in its own process (not the demo's in-driver server): serves
a folder on 127.0.0.1, waits `--delay` seconds per request (so a test can kill a run mid-download),
and appends every requested path to `--log`. Prints its port once it listens.

    python tests/site_server.py ROOT --delay 0.2 --log requests.txt
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer


class Handler(SimpleHTTPRequestHandler):
    delay = 0.0
    log_path = ""
    lock = threading.Lock()

    def do_GET(self):
        with self.lock, open(self.log_path, "a") as f:
            f.write(self.path + "\n")
        time.sleep(self.delay)
        super().do_GET()

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass    # a client that gave up mid-image (a killed run): expected here


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--log", required=True)
    args = p.parse_args()
    Handler.delay, Handler.log_path = args.delay, os.path.abspath(args.log)
    server = Server(("127.0.0.1", 0), partial(Handler, directory=args.root))
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
