"""``python -m context_engine.fake_provider --listen 127.0.0.1:8089``

Starts the fake provider on a loopback address, prints its base URL and serves until
interrupted (Ctrl-C or SIGTERM). Anthropic clients use the base URL as is; OpenAI clients
use ``<base URL>/v1``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .server import FakeProvider


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m context_engine.fake_provider")
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8089",
        help="loopback host:port to bind (port 0 picks a free one); default %(default)s",
    )
    args = parser.parse_args(argv)
    host, sep, port = args.listen.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or int(port) > 65535:
        parser.error("--listen must be host:port (a port from 0 to 65535)")
    provider = FakeProvider()
    try:
        base_url = provider.start(host=host, port=int(port))
    except ValueError as exc:  # not a loopback host: usage
        parser.error(str(exc))
    except OSError as exc:  # cannot bind: a start-up failure, not usage
        print(f"{parser.prog}: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    print(base_url, flush=True)
    print(f"  anthropic: base_url={base_url}  openai: base_url={base_url}/v1", file=sys.stderr)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        provider.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
