"""`raytrm cluster` on two real hosts: a head and a worker that joins with the token, a tuning job submitted with
`ray job submit`, each tier's trials on its own host, the profiles on the head. Driven only by raytrm's commands
(and Ray's job CLI, as the README shows)."""

from __future__ import annotations

import json
import re
import socket
import stat
import sys
import time

import optuna
import pytest
import torch
import yaml

from raytrm import config as cfg
from raytrm.train import checkpoint as ckpt

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HEAD_TIER, WORKER_TIER = "mac-desktop-16gb", "macbook-air-8gb"
SPACE = {
    "raytrm_space": 1,
    "name": "two-hosts",
    "base": {
        "model": {"variant": "mlp_t", "hidden_size": 32, "L_layers": 1, "H_cycles": 1, "L_cycles": 1},
        "data": {"name": "sudoku", "train_puzzles": 200, "test_puzzles": 16, "augment": 0, "givens": 40},
        "training": {"global_batch_size": 16, "lr": 3.0e-3, "warmup_steps": 2, "threads": 1},
    },
    "params": {"training.micro_batch_size": {"type": "categorical", "choices": [8, 16]}},
    "budget": {"warmup_s": 1, "measure_s": 2, "eval_puzzles": 16},
    "limits": {"max_throughput_decay": 1.0},
    "trials": 1,
    "tiers": [HEAD_TIER, WORKER_TIER],
}


# The HTTP status of a GET, with no credentials.
GET_STATUS = """
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
"""


def one_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stdout, done.stderr)
    assert lines[0].startswith("raytrm: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def cluster(hosts):
    """Head on a, then b tries to join without the token, with a wrong one, and with the head's."""
    a, b = hosts["a"], hosts["b"]
    # Before any head runs, `join` with no address finds none by mDNS.
    steps = {"nothing_found": b.raytrm("cluster", "join", "--tier", WORKER_TIER)}
    # The dashboard (job submission) on the LAN, so the worker can submit too; it still wants the token.
    steps["head"] = a.raytrm("cluster", "head", "--tier", HEAD_TIER, "--dashboard-host", "0.0.0.0", check=True)
    steps["no_token"] = b.raytrm("cluster", "join", a.ip, "--tier", WORKER_TIER)
    token = (a.home / ".ray" / "auth_token").read_text()
    wrong = b.root / "wrong_token"
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)
    steps["wrong_token"] = b.raytrm("cluster", "join", a.ip, "--tier", WORKER_TIER, "--token-file", str(wrong))
    steps["nodes_after_refusal"] = a.raytrm("cluster", "status", check=True)
    (b.home / ".ray").mkdir()
    copied = b.home / ".ray" / "auth_token"
    copied.write_text(token)  # what `scp HEAD:.ray/auth_token ~/.ray/auth_token` does
    copied.chmod(0o644)  # without the `chmod 600` after it
    steps["open_token"] = b.raytrm("cluster", "join", a.ip, "--tier", WORKER_TIER)
    copied.chmod(0o600)
    # The head's dashboard port: something answers there, but no Ray head.
    steps["dashboard_port"] = b.raytrm("cluster", "join", f"{a.ip}:8265", "--tier", WORKER_TIER)
    steps["join"] = b.raytrm("cluster", "join", "--tier", WORKER_TIER, check=True)  # no address: found by mDNS
    steps["status"] = a.raytrm("cluster", "status", check=True)
    steps["status_from_worker"] = b.raytrm("cluster", "status", check=True)
    yield steps
    for host in (b, a):
        host.raytrm("cluster", "stop")


def test_the_head_listens_on_its_lan_address_with_a_private_token(hosts, cluster):
    a = hosts["a"]
    out = cluster["head"].stdout
    assert f"head of tier {HEAD_TIER} at {a.ip}:6379" in out  # the only non-loopback address of the host
    assert f"raytrm cluster join {a.ip}:6379" in out and "scp" in out
    token = a.home / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64


def test_a_worker_without_the_token_is_refused(hosts, cluster):
    assert "no cluster token at" in one_line(cluster["no_token"]) and "scp" in one_line(cluster["no_token"])
    refused = one_line(cluster["wrong_token"])
    assert f"the head at {hosts['a'].ip}:6379 refused the cluster token at" in refused, refused
    assert "scp" in refused, refused
    # The head refused it: it still has one node.
    assert hosts["b"].ip not in cluster["nodes_after_refusal"].stdout


def test_a_token_copied_open_to_others_or_a_port_that_is_not_the_heads_is_one_line(hosts, cluster):
    copied = hosts["b"].home / ".ray" / "auth_token"
    assert f"the cluster token at {copied} is open to other users (mode 0644)" in one_line(cluster["open_token"])
    assert f"run `chmod 600 {copied}` and try again" in one_line(cluster["open_token"])
    refused = one_line(cluster["dashboard_port"])
    assert f"{hosts['a'].ip}:8265: something answers there, but not as a Ray head (its answer is not" in refused


def test_join_with_no_address_finds_the_head_by_mdns_or_says_none_answered(hosts, cluster):
    assert one_line(cluster["nothing_found"]).startswith("raytrm: error: no raytrm head answered by mDNS")
    assert "raytrm cluster join HEAD[:PORT]" in one_line(cluster["nothing_found"])
    assert "(or `raytrm cluster join` alone, which finds this head by mDNS" in cluster["head"].stdout
    # The record's name is the host name, which the rig's hosts share with this machine.
    name = socket.gethostname().split(".")[0]
    assert f"found the head {name} at {hosts['a'].ip}:6379 by mDNS" in cluster["join"].stdout, cluster["join"].stdout


def test_the_joined_cluster_shows_both_hosts_and_their_tiers(hosts, cluster):
    a, b = hosts["a"], hosts["b"]
    assert f"joined {a.ip}:6379 as a node of tier {WORKER_TIER} at {b.ip}" in cluster["join"].stdout
    for token in (a.home / ".ray" / "auth_token", b.home / ".ray" / "auth_token"):  # as the head and `join` left them
        assert stat.S_IMODE(token.stat().st_mode) == 0o600, token
    rows = {line.split()[0]: line.split() for line in cluster["status"].stdout.splitlines()}
    assert rows[a.ip][1:3] == [HEAD_TIER, "head"] and rows[b.ip][1:3] == [WORKER_TIER, "worker"]
    assert "(every node)" in cluster["status"].stdout and "jobs: none submitted" in cluster["status"].stdout
    assert b.ip in cluster["status_from_worker"].stdout


def test_a_job_submitted_from_the_worker_runs_each_tier_on_its_host_and_leaves_the_profiles_on_the_head(
    hosts, cluster, tmp_path
):
    a, b = hosts["a"], hosts["b"]
    work = tmp_path / "work"
    work.mkdir()
    (work / "space.yaml").write_text(yaml.safe_dump(SPACE))
    out = a.root / "runs" / "two-hosts"
    dashboard = f"http://{a.ip}:8265"
    unauthenticated = b.run(sys.executable, "-c", GET_STATUS, f"{dashboard}/api/jobs/")
    assert unauthenticated.stdout.strip() == "401", unauthenticated  # nobody without the token submits or looks
    # The job line exactly as the head printed it, run from the worker Mac with the token it joined with, in the
    # folder of the space file, with the space and the run directory appended.
    (printed,) = [line for line in cluster["head"].stdout.splitlines() if line.startswith("jobs, submitted")]
    assert printed.startswith("jobs, submitted from any Mac with the token: ") and dashboard in printed
    command = printed.partition(": ")[2]
    submit = b.run("bash", "-c", f"cd {work} && {command} --space space.yaml --out {out}", timeout=600)
    assert submit.returncode == 0 and "succeeded" in submit.stdout, submit.stdout + submit.stderr
    (job,) = re.findall(r"Job '([^']+)' submitted successfully", submit.stdout)
    for tier in (HEAD_TIER, WORKER_TIER):
        assert cfg.load_profile(out / "profiles" / f"{tier}.yaml").tier == tier
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    where = {
        tier: {
            t.user_attrs["node_address"]
            for t in optuna.load_study(study_name=f"two-hosts-{tier}", storage=storage).trials
        }
        for tier in (HEAD_TIER, WORKER_TIER)
    }
    assert where == {HEAD_TIER: {a.ip}, WORKER_TIER: {b.ip}}
    logs = a.run(
        sys.executable, "-m", "ray.scripts.scripts", "job", "logs", "--address", "http://127.0.0.1:8265",
        job, env={"RAY_AUTH_MODE": "token"}, check=True,
    )  # fmt: skip
    assert f"[{WORKER_TIER} #0] feasible" in logs.stdout and f"[{HEAD_TIER} #0] feasible" in logs.stdout
    assert "Traceback" not in logs.stdout, logs.stdout  # trials end quietly, also when Tune shuts them down
    exported = a.raytrm("export", str(out), "--tier", WORKER_TIER, "--out", str(tmp_path / "p.yaml"), check=True)
    assert "wrote the profile" in exported.stdout
    assert "SUCCEEDED" in a.raytrm("cluster", "status", check=True).stdout


def training_config(host, tmp_path, **training) -> dict:
    """A tiny TRM on Sudoku generated on host."""
    data = tmp_path / "sudoku"
    host.raytrm("data", "sudoku", "--out", str(data), "--count", "200", "--test-count", "16", check=True)
    model = {"hidden_size": 32, "L_layers": 1, "H_cycles": 2, "L_cycles": 1, "halt_max_steps": 3}
    base = {"global_batch_size": 24, "lr": 3e-3, "warmup_steps": 2, "threads": 1, "seed": 4}
    return {"model": model, "data": {"path": str(data)}, "training": {**base, **training}}


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(condition, driver, log, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert driver.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, what
        time.sleep(1)


def test_training_across_both_hosts_gives_the_one_process_update(hosts, cluster, tmp_path):
    """Ray Train workers on two hosts, joined by gloo over the veth pair, train as one process would."""
    a = hosts["a"]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(training_config(a, tmp_path, steps=4)))
    both, alone = tmp_path / "both", tmp_path / "alone"
    a.raytrm("train", "--config", str(config), "--address", "auto", "--out", str(both), check=True, timeout=400)
    a.raytrm("train", "--config", str(config), "--out", str(alone), check=True)  # one process, no Ray
    summary = json.loads((both / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["steps"] == 4 and sum(summary["shares"]) == 24
    trained = [ckpt.latest_good_checkpoint(d / "checkpoints") for d in (both, alone)]
    for key, value in trained[0]["model"].items():  # Adam turns fp32 rounding into at most ~lr a step
        torch.testing.assert_close(value, trained[1]["model"][key], rtol=0, atol=1e-2 * 3e-3, msg=key)


def test_training_goes_on_without_a_worker_whose_mac_leaves(hosts, cluster, tmp_path):
    """The worker's node stops mid-run: the driver restarts the group on the head alone, which resumes from the last
    checkpoint on one worker (same samples, another split) and finishes the run."""
    a, b = hosts["a"], hosts["b"]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(training_config(a, tmp_path, steps=40, checkpoint_interval=2, log_interval=1)))
    out, log = tmp_path / "run", tmp_path / "train.log"
    driver = a.popen(
        sys.executable, "-m", "raytrm.cli", "train", "--config", str(config), "--address", "auto", "--out", str(out),
        log=log,
    )  # fmt: skip
    try:
        wait_for(lambda: len(read_lines(out / "metrics.jsonl")) >= 10, driver, log, "the two workers never trained")
        assert all(len(r["workers"]) == 2 for r in read_lines(out / "metrics.jsonl") if "workers" in r)
        b.raytrm("cluster", "stop", check=True)  # the MacBook leaves mid-run
        driver.wait(timeout=500)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, log.read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40 and 0 < summary["resumed_from_step"] < 40
    assert "workers" not in summary  # the last attempt ran alone: one worker has no shares to report
    assert "a worker's machine left the cluster); restarting it on the 1 machine(s) left" in log.read_text()
    b.raytrm("cluster", "join", a.ip, "--tier", WORKER_TIER, check=True)  # back for the next test


def test_a_worker_lost_mid_tune_is_recorded_and_the_study_finishes_on_the_head(hosts, cluster, tmp_path):
    """Stops the worker's node while its trial runs: runs last in this module, since it leaves the head alone."""
    a, b = hosts["a"], hosts["b"]
    # A window long enough that the stop lands inside it: trials report progress every 5 s, and the MacBook's Ray is
    # stopped within a few seconds of the first report (a 14 s window once closed first on a loaded machine).
    space = {**SPACE, "name": "node-loss", "budget": {"warmup_s": 1, "measure_s": 20, "eval_puzzles": 16}}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    out = a.root / "runs" / "node-loss"
    # A driver on the head, as a person runs it there: no RAY_AUTH_MODE, the token file turns authentication on.
    log = tmp_path / "driver.log"
    driver = a.popen(
        sys.executable,
        "-m",
        "raytrm.cli",
        "tune",
        "--space",
        str(path),
        "--out",
        str(out),
        "--address",
        "auto",
        log=log,
    )
    try:
        wait_for(
            lambda: any(WORKER_TIER in p.read_text() for p in out.glob("ray/attempt-*/*/result.json")),
            driver,
            log,
            "the worker's trial never reported progress",
        )
        b.raytrm("cluster", "stop", check=True)  # the MacBook leaves mid-trial
        driver.wait(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
    output = log.read_text()
    assert driver.returncode == 0, output
    state = yaml.safe_load((out / "tune.yaml").read_text())
    assert list(state["lost_tiers"]) == [WORKER_TIER] and state["lost_tiers"][WORKER_TIER]["died"] == [0]
    assert f"tier {WORKER_TIER}" in output and "LOST" in output
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    lost = optuna.load_study(study_name=f"node-loss-{WORKER_TIER}", storage=storage).trials
    assert len(lost) == 1 and lost[0].state == optuna.trial.TrialState.COMPLETE
    attrs = lost[0].user_attrs
    assert attrs["status"] == "failed" and attrs["samples_per_sec"] > 0 and attrs["node_address"] == b.ip
    head = optuna.load_study(study_name=f"node-loss-{HEAD_TIER}", storage=storage).trials
    assert [t.user_attrs["status"] for t in head] == ["ok"]
    assert cfg.load_profile(out / "profiles" / f"{HEAD_TIER}.yaml").tier == HEAD_TIER
