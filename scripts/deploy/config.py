"""The deployment's settings: a typed ``DeployConfig``, built from the command line."""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from click import ClickException
from flwr.common.config import parse_config_args

from fl_rescaled.runspec import run_settings

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION = "Run the fl-rescaled Flower app on a local deployment: one SuperLink and N SuperNodes."
TAUS = next(f for f in run_settings() if f.key == "taus")  # the run config's own parser of ``taus``


def parse_nodes(text: str) -> tuple[int, ...]:
    """``--kill-node 1`` or ``--kill-node 1,4``: node indices (partition ids)."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected node indices such as 1 or 1,4, got {text!r}") from None


def parse_taus(text: str) -> list[float] | None:
    """``--taus 1,2,4`` as the ServerApp reads the run config's ``taus`` ("" gives None)."""
    try:
        return TAUS.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).split(": ", 1)[-1]) from None


@dataclass(frozen=True)
class DeployConfig:
    """Everything the deployment needs to know; ``__post_init__`` checks that it is consistent."""

    nodes: int = 3
    taus: tuple[float, ...] | None = None  # per-node mean compute times (node config ``tau``)
    run_config: str = ""  # passed to ``flwr run --run-config`` (keys of [tool.flwr.app.config])
    app: Path = ROOT
    port: int = 0  # SuperLink port; 0: a free one
    task_poll_interval: float = 0.05  # FLWR_SUPEREXEC_TASK_POLL_INTERVAL of the SuperNodes
    kill_nodes: tuple[int, ...] = ()  # SIGKILL these nodes mid-run (--kill-node) ...
    kill_random: int = 0  # ... or this many distinct nodes drawn at random
    kill_seed: int | None = None  # of the random nodes and times (None: a fresh one, reported)
    kill_after: float = 30.0  # kill times are uniform in [kill_after, kill_after + kill_spread]
    kill_spread: float = 0.0
    revive_after: float | None = None  # restart each killed node this long after its kill
    spare_replies: bool = False  # a kill waits while the node is sending a reply
    json_out: Path | None = None
    timeout: float = 1800.0
    startup_timeout: float = 120.0
    bin_dir: Path = Path(sys.executable).parent
    tmp_dir: Path | None = None
    keep: bool = False
    quiet: bool = False
    secure: bool = False  # TLS, SuperNode authentication, registered keys
    intruders: int = 0  # SuperNodes with unregistered keys, started when the run starts (--secure)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("--nodes must be at least 1")
        if self.taus is not None and len(self.taus) != self.nodes:
            raise ValueError(f"--taus has {len(self.taus)} values for {self.nodes} nodes")
        if not all(0 <= i < self.nodes for i in self.kill_nodes):
            raise ValueError("--kill-node must name node indices in 0..nodes-1")
        if len(set(self.kill_nodes)) != len(self.kill_nodes):
            raise ValueError("--kill-node names a node twice")
        if not 0 <= self.kill_random <= self.nodes:
            raise ValueError("--kill-random must be between 0 and --nodes")
        if self.kill_random and self.kill_nodes:
            raise ValueError("give either --kill-node or --kill-random, not both")
        if self.kill_after < 0 or self.kill_spread < 0 or (self.revive_after or 0.0) < 0:
            raise ValueError("--kill-after, --kill-spread and --revive-after must not be negative")
        if self.intruders < 0:
            raise ValueError("--intruders must be at least 0")
        if self.intruders and not self.secure:
            raise ValueError("--intruders needs --secure (without authentication any key is accepted)")

    def node_config(self, i: int) -> str:
        """``--node-config`` of SuperNode ``i``: its partition and, with ``taus``, its τ."""
        text = f"partition-id={i} num-partitions={self.nodes}"
        if self.taus is not None:
            text += f" tau={float(self.taus[i])!r}"
        return text

    def flwr_run_config(self) -> str:
        """The ``--run-config`` string, plus ``taus`` from ``--taus``; unknown keys are an error."""
        run_config = self.run_config.strip()
        keys = run_config_keys(run_config)
        if self.taus is not None and "taus" not in keys:
            run_config = f"{run_config} taus='{','.join(map(repr, self.taus))}'".strip()
            keys.append("taus")
        known = app_config_keys(self.app)
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise ValueError(f"unknown --run-config keys {unknown}: every key must exist in "
                             "[tool.flwr.app.config] of pyproject.toml")
        return run_config


def run_config_keys(run_config: str) -> list[str]:
    """The keys of a ``--run-config "k=v k2='x y'"`` string, parsed as ``flwr run`` parses it."""
    try:
        return list(parse_config_args([run_config]))
    except ClickException as err:
        raise ValueError(f"invalid --run-config {run_config!r}: {err.message}") from None


def app_config_keys(app: Path) -> set[str]:
    data = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))
    return set(data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="number of SuperNodes (default 3)")
    p.add_argument("--taus", type=parse_taus, default=None, help="per-node mean compute times, e.g. 1,2,4: "
                   "passed to each SuperNode as node config tau=τ_i and, unless --run-config sets taus, as run "
                   "config taus")
    p.add_argument("--run-config", default="", help="passed to flwr run --run-config (keys of "
                   "[tool.flwr.app.config])")
    p.add_argument("--app", default=str(ROOT), help="app directory to copy and run (default: the repository)")
    p.add_argument("--port", type=int, default=0, help="SuperLink port (default: a free one)")
    p.add_argument("--task-poll-interval", type=float, default=0.05,
                   help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL for the SuperNodes (default 0.05 s)")
    p.add_argument("--kill-node", type=parse_nodes, default=(), help="SIGKILL this node (partition id; "
                   "several: 1,4) mid-run, with its ClientApp processes")
    p.add_argument("--kill-random", type=int, default=0, help="SIGKILL this many distinct nodes drawn at random "
                   "(instead of --kill-node)")
    p.add_argument("--kill-seed", type=int, default=None, help="seed of the random nodes and kill times "
                   "(default: a fresh one, reported in the result's deployment section)")
    p.add_argument("--kill-after", type=float, default=30.0,
                   help="seconds after the run started to kill (default 30; never before the first reply "
                   "to a job, when the ServerApp has numbered the nodes); see --kill-spread")
    p.add_argument("--kill-spread", type=float, default=0.0, help="draw each node's kill time uniformly from "
                   "[--kill-after, --kill-after + this] (default 0: all at --kill-after)")
    p.add_argument("--revive-after", type=float, default=None,
                   help="restart each killed node this many seconds after its kill (new node id; with "
                   "--secure the same id, once the SuperLink lists the old one offline)")
    p.add_argument("--spare-replies", action="store_true", help="do not kill a node while it is sending a reply "
                   "(wait until it is sent, at most 10 s): killed mid-upload, the reply reaches the SuperLink "
                   "without its content, and Flower 1.42's ServerApp waits up to 180 s for it")
    p.add_argument("--json-out", default=None, help="write the result JSON here")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--bin-dir", default=None, help="directory with flwr, flower-superlink, flower-supernode "
                   "(default: that of this Python)")
    p.add_argument("--tmp-dir", default=None, help="parent of the scratch directory (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, FLWR_HOME)")
    p.add_argument("--quiet", action="store_true", help="do not echo the run's log")
    p.add_argument("--secure", action="store_true", help="TLS (a fresh CA and a server certificate for "
                   "127.0.0.1/localhost) and SuperNode authentication: one key pair per SuperNode, its public "
                   "key registered with `flwr supernode register` before the node starts")
    p.add_argument("--intruders", type=int, default=0, help="with --secure: start this many SuperNodes with "
                   "keys that are not registered when the run starts, and report how they were refused")
    return p


def parse_config(argv: list[str] | None = None) -> DeployConfig:
    """The command line as a ``DeployConfig``; a bad flag or value exits with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return DeployConfig(
            nodes=args.nodes, taus=tuple(args.taus) if args.taus else None, run_config=args.run_config,
            app=Path(args.app).resolve(), port=args.port, task_poll_interval=args.task_poll_interval,
            kill_nodes=args.kill_node, kill_random=args.kill_random, kill_seed=args.kill_seed,
            kill_after=args.kill_after, kill_spread=args.kill_spread, revive_after=args.revive_after,
            spare_replies=args.spare_replies,
            json_out=Path(args.json_out) if args.json_out else None, timeout=args.timeout,
            startup_timeout=args.startup_timeout,
            bin_dir=Path(args.bin_dir) if args.bin_dir else Path(sys.executable).parent,
            tmp_dir=Path(args.tmp_dir) if args.tmp_dir else None, keep=args.keep, quiet=args.quiet,
            secure=args.secure, intruders=args.intruders,
        )
    except ValueError as err:
        parser.error(str(err))
