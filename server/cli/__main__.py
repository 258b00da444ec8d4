"""``python -m xinserve.server.cli`` is the ``xinserve`` command."""

from xinserve.server.cli.main import run

run()
