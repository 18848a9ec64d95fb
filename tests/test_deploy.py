"""End-to-end tests on a real local Flower deployment (one SuperLink, several SuperNodes).

Each test starts its own deployment with ``scripts/deploy_local.py`` (loopback, free ports, a
scratch FLWR_HOME, no runtime dependency installation) and reads the ServerApp's JSON result.
Four deployments in all, about 8.5 minutes on a 2-core machine: two with three SuperNodes that
compare Vanilla and Rescaled ASGD (below, about 5 minutes), one with ten SuperNodes of which three
are killed and revived (about 2.5 minutes; section "SuperNodes killed and revived"), and one with
``--secure --intruders 1`` (TLS, SuperNode authentication, a SuperNode with an unregistered key;
about 40-50 s; see the section "secure deployment" further down).

Quadratic task, F_i(x) = (x − b_i)² with b = (0, 3, 6), no gradient noise, emulated compute
times τ = (1, 2, 4) × 3 s, two jobs in flight per node, wall clock. In a deployment each node's
delivery period is its emulated τ_i plus Flower's per-message cost (a fresh ClientApp process per
message: 3–4 s here), so the update counts c_i are less skewed than 1/τ_i. Vanilla ASGD drifts
to the frequency-weighted minimiser x_f = Σ c_i b_i / Σ c_i (computed from the counts it
observed); Rescaled ASGD, whose stepsizes use the online estimate of each node's delivery period,
to the equal-weight minimiser x_eq = 3.

Measured on the loaded development machine (load average 2–10 on 2 cores), two runs of this file:
delivery periods 6–7, 9–10 and 15–17 s; counts (19–21, 12–14, 8) in 135–150 s; x_f = 2.05–2.15.
Final iterates: Vanilla 1.99 and 1.97 (|x − x_f| = 0.05, 0.17); Rescaled 2.72 twice (|x − 3| =
0.28: the slowest node delivers only 8 times, so the transient from x0 = 0 has not died out; a
300 s run of the same configuration ends at 2.90). How much of the transient is left depends on
how many updates the machine managed in the wall-clock budget, so the test takes it out: the
gradient of the task's F_i = (x − b_i)² is 2 (x − b_i), each update x ← x − 2γ (x − b_i) shrinks
the distance to the fixed point x* by 1 − 2γ, and after updates of total stepsize S (the run's
cumulative stepsize) x ≈ x* + (x0 − x*) e^(−2S): the end point with the transient taken out is
x̂ = (x − x0 e^(−2S)) / (1 − e^(−2S)), whatever the load. A Monte Carlo model of these dynamics (per-message overhead 3–6 s, ±30 %
jitter, lr 0.1) puts the 99th percentile of either final error at 0.3–0.4. So each method's x̂ is
asserted to be closer to its own minimiser than to the other one and within ``TOL`` = 0.5 of it, and
the two minimisers to be at least ``MIN_GAP`` = 0.3 apart (if they are not, the per-message overhead
swamped the emulated τ and the test says so). Runtime: 5.3 minutes for these two deployments.

A deployment that needs Flower's executables (``flwr``, ``flower-superlink``, ``flower-supernode``
next to this Python) fails without them, unless ``FL_RESCALED_ALLOW_SKIP=deploy`` (conftest.py).
No test here puts a time limit on a deployment; ``scripts/deploy_local.py`` gives up after its own
default ``--timeout`` (30 minutes).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.cli.supernode.register import try_load_public_key  # what `flwr supernode register` reads keys with

from conftest import ROOT, assert_books_balance, missing  # noqa: E402

if str(ROOT / "scripts") not in sys.path:  # scripts/deploy/, as scripts/deploy_local.py imports it
    sys.path.insert(0, str(ROOT / "scripts"))

from deploy import config, credentials, evidence, kills, output  # noqa: E402
SCRIPT = ROOT / "scripts" / "deploy_local.py"
BIN = Path(sys.executable).parent
B = (0.0, 3.0, 6.0)
X_EQ = sum(B) / len(B)
TOL = 0.5
MIN_GAP = 0.3
QUAD = "quad-a='1,1,1' quad-b='0,3,6' noise=0.0 quad-x0=0.0"
TWO_JOBS = "strategy-options='jobs-per-node=2'"  # two jobs in flight per node (docs/deployment.md)
COMPARE = f"clock='wall' emulate='fixed' time-unit=3.0 budget=45.0 lr=0.1 {TWO_JOBS} ttl=90.0 {QUAD}"

def needs_flower() -> None:
    """Flower's executables next to this Python and a Linux /proc, or the test fails (skips only
    with ``FL_RESCALED_ALLOW_SKIP=deploy``)."""
    absent = [exe for exe in ("flwr", "flower-superlink", "flower-supernode") if not (BIN / exe).exists()]
    if absent or not Path("/proc").is_dir():
        missing("deploy", f"a local deployment needs {', '.join(absent) or 'a Linux /proc'} next to {sys.executable}")


def deployment_test(fn):
    """Marks of a test that starts a deployment (``-m "not deploy"`` leaves them out)."""
    return pytest.mark.deploy(pytest.mark.slow(fn))


def deploy(tmp_path: Path, name: str, run_config: str, *extra: str, nodes: int = 3, taus: str = "1,2,4") -> dict:
    """Run one local deployment; return the result JSON (with its ``deployment`` section)."""
    needs_flower()
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(SCRIPT), "--nodes", str(nodes), "--taus", taus, "--quiet",
           "--tmp-dir", str(tmp_path), "--json-out", str(out), "--run-config", run_config, *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    env.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    log = proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-4000:]
    assert proc.returncode == 0, f"deploy_local.py exited with {proc.returncode}:\n{log}"
    assert out.exists(), log
    result = json.loads(out.read_text())
    if os.environ.get("FL_RESCALED_DEPLOY_OUT"):  # keep the results (measurements for the docs)
        keep = Path(os.environ["FL_RESCALED_DEPLOY_OUT"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(out, keep / out.name)
    dep = result["deployment"]
    assert dep["leftover_pids"] == [], f"processes left behind: {dep['leftover_pids']}"
    assert not _processes_with(f"127.0.0.1:{dep['superlink_port']}"), "a Flower process outlived the run"
    assert not list(tmp_path.glob("fl-deploy-*")), "scratch directory not removed"
    return result


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != b"Z":
            found.append(int(entry))
    return found


def freq_minimiser(counts: list[int]) -> float:
    return sum(c * b for c, b in zip(counts, B)) / sum(counts)


def without_transient(res: dict, x0: float = 0.0) -> float:
    """The run's end point with what is left of the start taken out (module docstring):
    (x − x0 e^(−2S)) / (1 − e^(−2S)), S the run's cumulative stepsize."""
    left = math.exp(-2.0 * res["cumulative_stepsize"])
    return (res["final_params"][0] - x0 * left) / (1.0 - left)


@pytest.fixture(scope="module")
def compare_runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("deploy")
    return {s: deploy(tmp, s, f"strategy='{s}' {COMPARE}") for s in ("vanilla", "rescaled")}


@deployment_test
def test_vanilla_drifts_to_the_frequency_weighted_minimiser(compare_runs):
    res = compare_runs["vanilla"]
    counts = res["updates_per_worker"]
    x = without_transient(res)
    x_f = freq_minimiser(counts)
    info = (f"x={res['final_params'][0]:.3f} (without the transient {x:.3f}, S={res['cumulative_stepsize']:.3f}) "
            f"x_f={x_f:.3f} x_eq={X_EQ} counts={counts} nodes={res['deployment']['node_stats']}")
    assert all(c > 0 for c in counts), info
    assert counts[0] > counts[2], info  # the τ=1 node delivers more often than the τ=4 node
    assert X_EQ - x_f >= MIN_GAP, "per-message overhead swamped the emulated τ: " + info
    assert abs(x - x_f) < abs(x - X_EQ), info
    assert abs(x - x_f) < TOL, info
    assert sum(res["lost_per_worker"]) == 0 and not res["rejected"], res["rejected"]


@deployment_test
def test_rescaled_reaches_the_equal_weight_minimiser(compare_runs):
    res = compare_runs["rescaled"]
    x = without_transient(res)
    x_f = freq_minimiser(compare_runs["vanilla"]["updates_per_worker"])
    info = (f"x={res['final_params'][0]:.3f} (without the transient {x:.3f}, S={res['cumulative_stepsize']:.3f}) "
            f"x_eq={X_EQ} x_f(vanilla)={x_f:.3f} counts={res['updates_per_worker']} "
            f"nodes={res['deployment']['node_stats']}")
    assert all(c > 0 for c in res["updates_per_worker"]), info
    assert abs(x - X_EQ) < abs(x - x_f), info
    assert abs(x - X_EQ) < TOL, info
    assert abs(res["minimizer"] - X_EQ) < 1e-12
    assert sum(res["lost_per_worker"]) == 0 and not res["rejected"], res["rejected"]


# ---------------------------------------------------------------- SuperNodes killed and revived
# Ten SuperNodes (τ = 3 s emulated); three of them, drawn with a fixed seed, are SIGKILLed with
# their ClientApp processes at random times 30-40 s into the run (not before the first reply to a
# job) and restarted 25 s after their kills. One job in flight per node: on 2 cores ten nodes take
# ~10 s per message, and a second job queued behind the first would need a TTL twice as long. The
# TTL (25 s) is how long a dead node's job takes to be booked as lost; the revival waits as long, so
# the old job is settled before the new node (a new node id) answers the partition query. A kill
# waits while the node is uploading a reply (--spare-replies): a reply cut off mid-upload holds up
# Flower's ServerApp for up to 180 s (docs/deployment.md, "Ten SuperNodes, three killed and revived").
LOAD_NODES = 10
LOAD_JOBS_PER_NODE = 1
LOAD_KILLS = ("--kill-random", "3", "--kill-seed", "14", "--kill-after", "30", "--kill-spread", "10",
              "--revive-after", "25", "--spare-replies", "--task-poll-interval", "0.5")
LOAD = (f"strategy='rescaled' clock='wall' emulate='fixed' time-unit=1.0 budget=100.0 eval-every=50.0 lr=0.02 "
        f"strategy-options='jobs-per-node={LOAD_JOBS_PER_NODE}' ttl=25.0 noise=0.0 quad-x0=0.0 "
        f"quad-a='{','.join(['1'] * LOAD_NODES)}' quad-b='{','.join(map(str, range(LOAD_NODES)))}'")
LOST_REASONS = ("ttl-expired", "error-code-3", "error-code-5")  # no reply: the job's node is gone


@deployment_test
def test_supernodes_killed_and_revived_cost_only_their_jobs_in_flight(tmp_path):
    """10 SuperNodes, 3 killed at random times and revived: the run reaches its budget, its books
    balance, the only jobs lost are those in flight on a killed node when it died, and each revived
    node delivers again. (About 2.5 minutes on a 2-core machine.)"""
    res = deploy(tmp_path, "kill", LOAD, *LOAD_KILLS, nodes=LOAD_NODES, taus=",".join(["3"] * LOAD_NODES))
    dep, books = res["deployment"], res["books"]
    n = LOAD_NODES
    killed = {k["node"]: k for k in dep["kills"]}
    info = json.dumps({k: res[k] for k in ("updates_per_worker", "lost_per_worker", "rejected", "books")}
                      ) + f" kills={dep['kills']} nodes={dep['node_stats']}"
    assert len(killed) == 3 and all(k["killed_at"] is not None and k["revived_at"] is not None
                                    for k in killed.values()), info
    assert res["final_time"] == pytest.approx(res["budget"]), info  # the run went to the end
    assert_books_balance(books, info)  # the books balance, per worker
    assert sum(books["applied-per-worker"]) == res["num_updates"] == sum(res["updates_per_worker"]), info
    # nothing is lost but the jobs in flight on a killed node when it died, and nothing else is rejected
    for i in range(n):
        lost = res["lost_per_worker"][i]
        if i in killed:
            assert 1 <= lost <= LOAD_JOBS_PER_NODE, f"worker {i}: {info}"
        else:
            assert lost == 0, f"worker {i} was never killed but lost {lost} jobs: {info}"
    assert books["rejected-per-worker"] == [0] * n, info  # (lost jobs are booked apart)
    assert set(res["rejected"]) <= set(LOST_REASONS), info
    assert sum(res["rejected"].values()) == sum(res["lost_per_worker"]) == books["lost"], info
    # every node delivered; each revived node after its revival too, and the server applied it (the
    # worker's updates outnumber the replies its node sent before it was killed)
    assert all(c > 0 for c in res["updates_per_worker"]), info
    for i, k in killed.items():
        assert k["replies_after_revival"] >= 1, f"node {i} did not deliver after its revival: {info}"
        assert res["updates_per_worker"][i] > k["replies_before_kill"], f"worker {i}: {info}"
    assert all(math.isfinite(v) for v in res["final_params"]) and math.isfinite(res["final_loss"]), info


def test_kills_are_drawn_from_the_seed_and_spare_a_reply_being_sent():
    """--kill-random draws distinct nodes, and times in [after, after + spread], from --kill-seed;
    --kill-node keeps its nodes; with --spare-replies a kill waits until the node's reply is sent,
    and the revival follows --revive-after seconds later (cheap; runs everywhere)."""
    cfg = config.parse_config(["--nodes", "10", "--kill-random", "3", "--kill-seed", "14", "--kill-after", "30",
                               "--kill-spread", "10", "--revive-after", "25", "--spare-replies"])
    plan, seed = kills.plan_kills(cfg)
    assert seed == 14 and [(k.node, k.at) for k in plan] == [(k.node, k.at) for k in kills.plan_kills(cfg)[0]]
    assert len({k.node for k in plan}) == 3 and all(30.0 <= k.at <= 40.0 for k in plan)
    assert [k.at for k in plan] == sorted(k.at for k in plan)
    one, _ = kills.plan_kills(config.parse_config(["--kill-node", "1", "--kill-after", "12"]))
    assert [(k.node, k.at) for k in one] == [(1, 12.0)]

    dep = FakeDeployment(cfg)
    k = plan[0]
    name = f"node{k.node}"
    dep.events.feed(name, time.time(), "INFO :      Sending: train message (ID: 1)")
    reaper = kills.Reaper([k], dep, revive_after=25.0, spare_replies=True)
    reaper.step(k.at)
    assert dep.done == []  # due, but the node is sending a reply
    dep.events.feed(name, time.time(), "INFO :      Sent successfully")
    reaper.step(k.at + 0.2)
    reaper.step(k.at + 25.0)
    assert dep.done == [("kill", k.node)]
    reaper.step(k.at + 25.5)
    assert dep.done == [("kill", k.node), ("start", k.node)]
    [row] = reaper.report(dep.events)
    assert (row["node"], row["killed_at"], row["revived_at"]) == (k.node, round(k.at + 0.2, 2), round(k.at + 25.5, 2))
    assert not row["killed_while_sending"] and (row["replies_before_kill"], row["replies_after_revival"]) == (1, 0)


class FakeDeployment:
    """What ``kills.Reaper`` uses of a ``LocalDeployment``; records the kills and starts."""

    def __init__(self, cfg: config.DeployConfig) -> None:
        self.config, self.events, self.done = cfg, output.NodeEvents(), []

    def kill_node(self, i: int) -> None:
        self.done.append(("kill", i))

    def start_node(self, i: int) -> SimpleNamespace:
        self.done.append(("start", i))
        return SimpleNamespace(pid=0)


def test_deploy_script_help():
    """The script's CLI parses (cheap; runs everywhere)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--kill-node" in proc.stdout


def test_run_config_keys_are_checked(tmp_path):
    """An unknown --run-config key fails before anything is started."""
    if shutil.which("flwr", path=str(BIN)) is None:
        missing("deploy", f"no flwr executable next to {sys.executable}")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "1", "--tmp-dir", str(tmp_path),
                           "--run-config", "no-such-key=1"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "no-such-key" in proc.stdout + proc.stderr


# ---------------------------------------------------------------- secure deployment (--secure)
# Two SuperNodes with registered keys, TLS everywhere the script can reach, and one intruder: a
# SuperNode with a fresh key that was never registered, started once a registered node has replied
# to a job (the ServerApp is then handing out jobs to every node the SuperLink lists). One
# deployment of ~20 s wall budget (about 50 s in all) serves both tests.
SECURE = (f"strategy='rescaled' clock='wall' emulate='fixed' time-unit=1.0 budget=20.0 lr=0.1 {TWO_JOBS} "
          "ttl=60.0 quad-a='1,1' quad-b='0,3' noise=0.0 quad-x0=0.0")


@pytest.fixture(scope="module")
def secure_run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("secure")
    return deploy(tmp, "secure", SECURE, "--secure", "--intruders", "1", nodes=2, taus="1,1")


@deployment_test
def test_a_secure_deployment_trains_the_registered_supernodes(secure_run):
    res, dep = secure_run, secure_run["deployment"]
    info = json.dumps({k: res[k] for k in ("updates_per_worker", "lost_per_worker", "rejected")}) + str(dep)
    assert dep["secure"] is True, info
    assert dep["tls_health"] is True and dep["plain_http_health"] is False, info  # TLS only, verified by our CA
    registered = dep["registered_node_ids"]
    assert len(set(registered)) == 2, info
    assert res["final_time"] == pytest.approx(res["budget"]), info  # the run went to the end
    assert len(res["updates_per_worker"]) == 2 and all(c > 0 for c in res["updates_per_worker"]), info
    assert res["num_updates"] == sum(res["updates_per_worker"]), info
    assert sum(res["lost_per_worker"]) == 0 and not res["rejected"], info
    assert sorted(dep["reply_node_ids"]) == sorted(registered), info  # the SuperLink took replies from both
    assert all(math.isfinite(v) for v in res["final_params"]) and res["final_params"][0] > 0.0, info


@deployment_test
def test_a_supernode_with_an_unregistered_key_is_refused_and_gets_no_job(secure_run):
    res, dep = secure_run, secure_run["deployment"]
    info = str(dep)
    [intruder] = dep["intruders"]
    # its own log: refused at activation (ApiErrorCode 2004), and the process exited
    assert intruder["exit_code"] not in (None, 0), info
    assert intruder["refusal"].startswith("[code: 2004] Failed to activate SuperNode"), info
    # the SuperLink's log names the refused key, and it is the intruder's public key
    assert intruder["superlink_refused_key"] is True and intruder["refused"] is True, info
    # refused while the run was still handing out jobs, and it never received a message
    assert dep["intruders_started_at_seconds"] < dep["run_seconds"], info
    assert intruder["refused_at"] < dep["last_reply_at"], info
    assert intruder["messages_received"] == 0, info
    # the SuperLink lists the registered nodes only, and the run's books count two workers
    assert sorted(nd["node_id"] for nd in dep["superlink_nodes"]) == sorted(dep["registered_node_ids"]), info
    assert len(res["updates_per_worker"]) == len(res["lost_per_worker"]) == 2, info


def test_secure_credentials_are_what_flower_reads(tmp_path):
    """The CA, the server certificate (SANs 127.0.0.1 and localhost) and a SuperNode key pair in
    the formats flower-supernode and `flwr supernode register` load (cheap; runs everywhere)."""
    tls = credentials.write_tls(tmp_path / "tls")
    ca = x509.load_pem_x509_certificate(tls.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(tls.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = credentials.write_node_key(tmp_path / "keys", "node0")
    assert key.private.stat().st_mode & 0o777 == 0o600 and tls.server_key.stat().st_mode & 0o777 == 0o600
    private = load_ssh_private_key(key.private.read_bytes(), None)  # as flower-supernode does
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    pem = try_load_public_key(key.public)
    assert key.spki_base64() in pem.decode().replace("\n", "")


def test_refusals_are_read_from_the_superlink_log(tmp_path):
    """The SuperLink's ApiError:2004 line is matched to the refused key (cheap; runs everywhere)."""
    key = credentials.write_node_key(tmp_path, "intruder0")
    body = key.spki_base64()
    pem = "-----BEGIN PUBLIC KEY-----\\n" + "\\n".join(body[i:i + 64] for i in range(0, len(body), 64))
    line = ("1.0 ERROR :     [/v1/fleet/activate-node][ApiError:2004] Attempted to register SuperNode with "
            f"public key: b'{pem}\\n-----END PUBLIC KEY-----\\n', exception: No SuperNode found")
    assert evidence.refused_keys(line) == {body}
    assert evidence.refused_keys(line.replace("2004", "2001")) == set()
    log = "x [Fleet.PushMessages] Push replies from node_id=12\ny Push replies from node_id=3\nz node_id=12"
    assert evidence.reply_node_ids(log + "\nPush replies from node_id=12") == [12, 3]


def test_intruders_need_secure(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "1", "--intruders", "1", "--tmp-dir",
                           str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "--intruders needs --secure" in proc.stderr
