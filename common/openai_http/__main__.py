"""An API-server process of a daemon's HTTP front: common/openai_http/api_server.py."""
from __future__ import annotations

import asyncio
import signal
import sys

from common.openai_http.api_server import ApiServerSettings, raise_fd_limit, serve
from common.serving.daemon import setup_logging


def main() -> int:
    settings = ApiServerSettings.from_json(sys.stdin.readline())
    setup_logging(settings.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the daemon, which stops us
    try:
        from uvloop import run
    except ImportError:  # the standard event loop serves too, more slowly
        run = asyncio.run
    run(serve(settings, raise_fd_limit()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
