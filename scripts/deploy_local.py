#!/usr/bin/env python3
"""Run the fl-rescaled Flower app on a local deployment: one SuperLink and N SuperNodes.

Everything binds to 127.0.0.1 on free ports and lives in a scratch directory under /tmp
(``FLWR_HOME`` of every process, logs, a copy of the app). The script (package ``scripts/deploy/``)

1. copies the app (pyproject.toml and the Python packages, no virtualenv, caches or results) to
   the scratch directory, so that ``flwr run`` never touches the repository's pyproject.toml;
2. starts ``flower-superlink --insecure --disable-runtime-dependency-installation`` and waits
   for its ``/health`` endpoint;
3. starts N ``flower-supernode --insecure`` processes, node i with
   ``--node-config "partition-id=i num-partitions=N [tau=τ_i]"`` and its own Runtime API port,
   with ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` lowered (default 0.05 s), and waits until
   ``flwr supernode ls`` reports all N online;
4. writes the connection ``[superlink.local-deploy]`` into ``$FLWR_HOME/config.toml`` and runs
   ``flwr run <app copy> local-deploy --stream --run-config "..."``, echoing its log;
5. optionally SIGKILLs SuperNodes (each one's whole process group) mid-run, chosen or drawn at
   random, at chosen or random times, and restarts each one later;
6. extracts the ServerApp's ``fl-rescaled result: {json}`` line, prints it and writes it to
   ``--json-out`` (with a ``deployment`` section of timings);
7. on exit, Ctrl-C, SIGTERM or error stops every process it started, by PID: each one's process
   group, then any process that still carries this run's marker in its environment (the
   SuperLink starts its SuperExec in a new session), and checks that none is left.

With ``--secure`` it makes a CA, a server certificate for 127.0.0.1/localhost and one key pair per
SuperNode; starts the SuperLink with TLS (``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``) and
``--enable-supernode-auth``; registers each SuperNode's public key with ``flwr supernode register``;
starts the SuperNodes with ``--root-certificates`` and ``--auth-supernode-private-key``; and points
the CLI at the CA (``root-certificates``). ``--intruders K`` then starts K SuperNodes with keys that
were never registered, once the run has started, and records in the ``deployment`` section how each
was refused (exit status 1 if one was not).

Example::

    .venv/bin/python scripts/deploy_local.py --nodes 3 --taus 1,2,4 \\
        --run-config "budget=6.0 quad-a='1,1,1' quad-b='0,1,2' lr=0.1"

Exit status: 0 with a result, 1 without one (the run failed), 2 on timeout, 130 on Ctrl-C.
"""

import sys

from deploy import main  # scripts/deploy/, next to this file

if __name__ == "__main__":
    sys.exit(main())
