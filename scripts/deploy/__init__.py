"""Run the fl-rescaled Flower app on a local deployment: one SuperLink and N SuperNodes.

The pieces, one idea each:

- ``config.py``: ``DeployConfig``, the typed settings, and the command line that builds them;
- ``deployment.py``: ``LocalDeployment``, the SuperLink, the SuperNodes and the Flower CLI calls;
- ``credentials.py``: the CA, the server certificate and the SuperNode key pairs of ``--secure``;
- ``processes.py``: starting processes in their own sessions and stopping every one of them;
- ``output.py``: the result line, the nodes' timings, the script's log;
- ``evidence.py``: how SuperNodes with unregistered keys were refused (``--intruders``);
- ``kills.py``: SuperNodes killed mid-run and revived (``--kill-node``, ``--kill-random``);
- ``session.py``: one deployment from start to report, and ``main``.

``scripts/deploy_local.py`` is the command line; its docstring describes what a run does.
"""

from .session import main

__all__ = ["main"]
