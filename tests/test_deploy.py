"""End-to-end tests on a real local Flower deployment (one SuperLink, three SuperNodes).

Each test starts its own deployment with ``scripts/deploy_local.py`` (loopback, free ports, a
scratch FLWR_HOME, no runtime dependency installation) and reads the ServerApp's JSON result.
Four deployments in all, about 8 minutes on a 2-core machine: three insecure ones (below), and one
with ``--secure --intruders 1`` (TLS, SuperNode authentication, a SuperNode with an unregistered
key; about 50 s; see the section "secure deployment" further down).

Quadratic task, F_i(x) = (x − b_i)²/2 with b = (0, 3, 6), no gradient noise, emulated compute
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
300 s run of the same configuration ends at 2.90). A Monte Carlo model of these dynamics
(per-message overhead 3–6 s, ±30 % jitter, lr 0.1) puts the 99th percentile of either final error
at 0.3–0.4. So each method is asserted to be closer to its own minimiser than to the other one and
within ``TOL`` = 0.5 of it, and the two minimisers to be at least ``MIN_GAP`` = 0.3 apart (if they
are not, the per-message overhead swamped the emulated τ and the test says so). Runtime: 6.6–6.8
minutes for the three deployments.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.cli.supernode.register import try_load_public_key  # what `flwr supernode register` reads keys with

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:  # scripts/deploy/, as scripts/deploy_local.py imports it
    sys.path.insert(0, str(ROOT / "scripts"))

from deploy import credentials, evidence  # noqa: E402
SCRIPT = ROOT / "scripts" / "deploy_local.py"
BIN = Path(sys.executable).parent
B = (0.0, 3.0, 6.0)
X_EQ = sum(B) / len(B)
TOL = 0.5
MIN_GAP = 0.3
QUAD = "quad-a='1,1,1' quad-b='0,3,6' noise=0.0 quad-x0=0.0"
TWO_JOBS = "strategy-options='jobs-per-node=2'"  # two jobs in flight per node (docs/deployment.md)
COMPARE = f"clock='wall' emulate='fixed' time-unit=3.0 budget=45.0 lr=0.1 {TWO_JOBS} ttl=90.0 {QUAD}"
KILL = f"clock='wall' emulate='fixed' time-unit=0.5 budget=150.0 lr=0.05 {TWO_JOBS} ttl=20.0 {QUAD}"

needs_flower = pytest.mark.skipif(
    not all((BIN / exe).exists() for exe in ("flwr", "flower-superlink", "flower-supernode"))
    or not Path("/proc").is_dir(),
    reason="needs the Flower executables next to this Python and a Linux /proc",
)


def deployment_test(fn):
    """Marks of a test that starts a deployment (``-m "not deploy"`` leaves them out)."""
    return pytest.mark.deploy(pytest.mark.slow(needs_flower(fn)))


def deploy(tmp_path: Path, name: str, run_config: str, *extra: str, timeout: float = 420.0,
           nodes: int = 3, taus: str = "1,2,4") -> dict:
    """Run one local deployment; return the result JSON (with its ``deployment`` section)."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(SCRIPT), "--nodes", str(nodes), "--taus", taus, "--quiet",
           "--timeout", str(timeout - 30), "--tmp-dir", str(tmp_path), "--json-out", str(out),
           "--run-config", run_config, *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    env.update(FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
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


@pytest.fixture(scope="module")
def compare_runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("deploy")
    return {s: deploy(tmp, s, f"strategy='{s}' {COMPARE}") for s in ("vanilla", "rescaled")}


@deployment_test
def test_vanilla_drifts_to_the_frequency_weighted_minimiser(compare_runs):
    res = compare_runs["vanilla"]
    counts = res["updates_per_worker"]
    x = res["final_params"][0]
    x_f = freq_minimiser(counts)
    info = f"x={x:.3f} x_f={x_f:.3f} x_eq={X_EQ} counts={counts} nodes={res['deployment']['node_stats']}"
    assert all(c > 0 for c in counts), info
    assert counts[0] > counts[2], info  # the τ=1 node delivers more often than the τ=4 node
    assert X_EQ - x_f >= MIN_GAP, "per-message overhead swamped the emulated τ: " + info
    assert abs(x - x_f) < abs(x - X_EQ), info
    assert abs(x - x_f) < TOL, info
    assert sum(res["lost_per_worker"]) == 0 and not res["rejected"], res["rejected"]


@deployment_test
def test_rescaled_reaches_the_equal_weight_minimiser(compare_runs):
    res = compare_runs["rescaled"]
    x = res["final_params"][0]
    x_f = freq_minimiser(compare_runs["vanilla"]["updates_per_worker"])
    info = (f"x={x:.3f} x_eq={X_EQ} x_f(vanilla)={x_f:.3f} counts={res['updates_per_worker']} "
            f"nodes={res['deployment']['node_stats']}")
    assert all(c > 0 for c in res["updates_per_worker"]), info
    assert abs(x - X_EQ) < abs(x - x_f), info
    assert abs(x - X_EQ) < TOL, info
    assert abs(res["minimizer"] - X_EQ) < 1e-12
    assert sum(res["lost_per_worker"]) == 0 and not res["rejected"], res["rejected"]


@deployment_test
def test_a_killed_supernode_costs_lost_jobs_not_the_run(tmp_path):
    """SIGKILL node 1 (and its ClientApp processes) 30 s into the run; TTL 20 s."""
    res = deploy(tmp_path, "kill", f"strategy='rescaled' {KILL}", "--kill-node", "1", "--kill-after", "30")
    dep = res["deployment"]
    info = json.dumps({k: res[k] for k in ("updates_per_worker", "lost_per_worker", "rejected")}) + str(dep)
    assert dep["killed_node"] == 1, info
    assert res["final_time"] == pytest.approx(res["budget"]), info  # the run went to the end
    assert res["lost_per_worker"][1] >= 1, info
    rejected_lost = sum(n for reason, n in res["rejected"].items()
                        if reason in ("ttl-expired", "error-code-3", "error-code-5"))
    assert rejected_lost >= sum(res["lost_per_worker"]) > 0, info  # every lost job is booked as rejected
    assert res["updates_per_worker"][0] > 0 and res["updates_per_worker"][2] > 0, info
    assert all(math.isfinite(v) for v in res["final_params"]), info
    assert math.isfinite(res["final_loss"]), info


def test_deploy_script_help():
    """The script's CLI parses (cheap; runs everywhere)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--kill-node" in proc.stdout


def test_run_config_keys_are_checked(tmp_path):
    """An unknown --run-config key fails before anything is started."""
    if shutil.which("flwr", path=str(BIN)) is None:
        pytest.skip("no flwr executable next to this Python")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "1", "--tmp-dir", str(tmp_path),
                           "--run-config", "no-such-key=1"], capture_output=True, text=True, timeout=60)
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
    return deploy(tmp, "secure", SECURE, "--secure", "--intruders", "1", nodes=2, taus="1,1", timeout=300.0)


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
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--intruders needs --secure" in proc.stderr
