"""The sweep on a real SLURM cluster: `workflow/profiles/slurm` with the real executor plugin (sbatch, srun,
squeue), against the one-node cluster of `make slurm-up` (tools/cluster/slurm_local.sh). Not a dry run.

One reduced sweep (one tiny model x baseline/rope/full, 16 steps) goes through the profile while a local run
of the same config gives the reference; meanwhile
  - the `full` training job is preempted (`scontrol requeue`) once it has a checkpoint,
  - the training command of `rope` is killed (SIGKILL, a crash) once it has a checkpoint,
  - the training command of `baseline` is killed (SIGKILL) in the middle of saving checkpoint-8, after its
    optimizer file (``ROUNDALIGN_FAULT_INJECT``, roundalign.training.checkpoints), so its retry finds it incomplete,
  - a second, minimal workflow through the same profile has a job over its 1-minute time limit and a job
    whose command always fails (after writing a checkpoint outside its outputs), with later jobs behind.
The tests below check the outcome of that one module-scoped run. Without a cluster they skip, naming
`make slurm-up`; under CI (CI=true) that is a failure instead.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from roundalign.training.checkpoints import MARKER
from roundalign.training.train import TIMING_KEYS

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SLURM_DIR = Path(os.environ.get("ROUNDALIGN_SLURM_DIR", "/tmp/roundalign-slurm"))
SWEEP, MODEL = "slurmtest", "tiny-qwen3-tied"
VARIANTS = ("baseline", "rope", "full")
# the status checks of the plugin start 40 s after each finished job by default; these only make the test
# faster (requirement: the profile itself needs no edits, only environment variables)
FAST = ["--slurm-init-seconds-before-status-checks", "2", "--seconds-between-status-checks", "2",
        "--slurm-keep-successful-logs"]
# Not using `pytest.mark.timeout` (no plugin): every wait below has its own deadline.
DEADLINE_S = 540


def _cluster_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_ACCOUNT", "SLURM_PARTITION")}
    env.update(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    if "SLURM_CONF" not in env and (SLURM_DIR / "slurm.conf").is_file():
        env["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    return env


def _require_cluster(env: dict) -> None:
    state, conf = "", Path(env.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    # without a config file sinfo looks for a cluster through DNS and can hang: do not ask it then
    if shutil.which("sinfo") and conf.is_file():
        try:
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True,
                                 timeout=15)
            state = res.stdout.strip() if res.returncode == 0 else ""
        except subprocess.TimeoutExpired:
            pass
    if not re.match(r"(idle|mixed|allocated|completing)", state):
        msg = (f"no usable SLURM cluster (config {conf}, node state {state or 'unknown'!r}): run `make slurm-up` "
               "(root + apt; `make test` does it itself) or point SLURM_CONF at a cluster")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI must run the SLURM tests: " + msg)
        pytest.skip(msg)


def _copy_workflow(dest: Path) -> Path:
    for name in ("Snakefile", "environment.yml"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("workflow", "configs"):
        shutil.copytree(ROOT / name, dest / name)
    cfg = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    cfg["sweep"] = SWEEP
    cfg["models"] = {MODEL: {"source": "tiny", "tiny": {"arch": "qwen3", "tie": True, "pretrain_steps": 40}}}
    cfg["variants"] = list(VARIANTS)
    cfg["train"].update(steps=16, checkpoint_every=4)
    cfg["probe"] = {"engines": ["vllm-eager"], "prompts": 4, "max_new_tokens": 8}
    # the smoke sweep's attribution, reduced: one more job through sbatch
    cfg["attribution"] = {**cfg.get("attribution", {}), "enabled": True, "engines": ["vllm-eager"], "prompts": 4,
                          "max_new_tokens": 8, "resamples": 50}
    (dest / "reduced.yaml").write_text(yaml.safe_dump(cfg))
    return dest


# The profile's retries, time limits and keep-going on jobs that cost no CPU: `slow` sleeps past its 1-minute
# limit on attempt 1 and ends at once on attempt 2 (2 minutes); `broken` writes a checkpoint outside its
# outputs and fails, on every attempt; `later` only starts after `slow`, long after `broken` failed.
MINI_SNAKEFILE = """
rule all:
    input:
        "limit.txt",
        "broken.txt",
        "later.txt",


rule slow:
    output:
        "limit.txt",
    log:
        "logs/slow.log",
    resources:
        runtime=lambda wc, attempt: attempt,
        mem_mb=100,
        nap=lambda wc, attempt: 600 if attempt == 1 else 0,
    shell:
        "sleep {resources.nap}; squeue -h -j $SLURM_JOB_ID -o %l > {output} 2> {log}"


rule broken:
    output:
        "broken.txt",
    log:
        "logs/broken.log",
    resources:
        mem_mb=100,
        runtime=1,
    shell:
        "mkdir -p work/broken && echo step > work/broken/checkpoint-$SLURM_JOB_ID; "
        "echo writing {output} > {log}; exit 3"


rule later:
    input:
        "limit.txt",
    output:
        "later.txt",
    resources:
        mem_mb=100,
        runtime=1,
    shell:
        "touch {output}"
"""


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _slurm_job_of(env: dict, variant: str) -> str | None:
    # the plugin's --comment names the rule and the wildcard values of each job
    out = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i|%k"], env=env, capture_output=True, text=True).stdout
    for line in out.splitlines():
        jobid, _, comment = line.partition("|")
        if comment == _comment(variant):
            return jobid
    return None


def _comment(variant: str) -> str:
    return f"rule_train_wildcards_{SWEEP}_{MODEL}_{variant}_0"


def _has_checkpoint(run_dir: Path) -> bool:
    """A *complete* checkpoint (its marker written last): trainer_state.json alone can precede the rest of the
    save by seconds on a loaded machine, and a kill in that window leaves nothing to resume from (seen in CI
    with both test environments running side by side: the retry rightly restarted from step 0)."""
    return bool(list((run_dir / "checkpoints").glob(f"checkpoint-*/{MARKER}")))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    env = _cluster_env()
    _require_cluster(env)
    t0 = time.time()
    slurm_wf = _copy_workflow(tmp_path_factory.mktemp("slurm"))
    local_wf = _copy_workflow(tmp_path_factory.mktemp("local"))
    mini_wf = tmp_path_factory.mktemp("mini")
    (mini_wf / "Snakefile").write_text(MINI_SNAKEFILE)
    shutil.copytree(ROOT / "workflow/profiles/slurm", mini_wf / "profile")

    def start(wf, args, name, extra_env=None):
        out = open(wf / f"{name}.out", "w")
        return subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=wf, env={**env, **(extra_env or {})},
                                stdout=out, stderr=subprocess.STDOUT, text=True), wf / f"{name}.out"

    runs = [f"results/{SWEEP}/runs/{MODEL}/{v}/seed0/run.json" for v in VARIANTS]
    # the jobs inherit the environment (sbatch --export=ALL): the first `baseline` attempt dies inside its save
    fault = {"ROUNDALIGN_FAULT_INJECT": f"after_optimizer@8@{slurm_wf / 'fault-fired'}@/baseline/"}
    slurm, slurm_out = start(slurm_wf, ["--profile", "workflow/profiles/slurm", "--configfile", "reduced.yaml",
                                        *FAST], "snakemake", fault)
    mini, mini_out = start(mini_wf, ["--profile", "profile", *FAST], "snakemake")
    # the reference: the same config, locally, one core (the SLURM node's jobs use the other)
    local, _ = start(local_wf, [*runs, "--cores", "1", "--configfile", "reduced.yaml"], "snakemake")

    run_dir = {v: slurm_wf / f"work/runs/{SWEEP}/{MODEL}/{v}/seed0" for v in VARIANTS}
    requeued = crashed = None
    deadline = t0 + DEADLINE_S
    while slurm.poll() is None and time.time() < deadline:
        if requeued is None and _has_checkpoint(run_dir["full"]):
            jobid = _slurm_job_of(env, "full")
            if jobid:
                subprocess.run(["scontrol", "requeue", jobid], env=env, check=True)
                requeued = {"jobid": jobid, "released": False}
        elif requeued and not requeued["released"]:
            # a requeued job waits ~2 min before it is eligible again: once it is back in the queue, let it go
            state = subprocess.run(["squeue", "-h", "-j", requeued["jobid"], "-o", "%T|%r"], env=env,
                                   capture_output=True, text=True).stdout.strip()
            if state == "PENDING|BeginTime":
                subprocess.run(["scontrol", "update", f"jobid={requeued['jobid']}", "starttime=now"], env=env,
                               check=True)
                requeued["released"] = True
        if crashed is None and _has_checkpoint(run_dir["rope"]):
            # the python process only (not the shell around it): the job's command fails with 137
            pids = _pids(f"^python[0-9.]* -m roundalign train .*--out {run_dir['rope'].relative_to(slurm_wf)} ")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            if pids:
                crashed = {"pids": pids, "checkpoints": sorted(p.name for p in (run_dir["rope"] / "checkpoints")
                                                               .iterdir() if p.name.startswith("checkpoint-"))}
        time.sleep(0.05)
    t_slurm = time.time() - t0
    for proc in (slurm, mini, local):
        try:
            proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=60)
    jobs = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i|%a|%P|%k|%T|%l"], env=env, capture_output=True,
                          text=True).stdout
    return SimpleNamespace(env=env, slurm_wf=slurm_wf, local_wf=local_wf, mini_wf=mini_wf, run_dir=run_dir,
                           rc=slurm.returncode, out=slurm_out.read_text(), local_rc=local.returncode,
                           local_out=(local_wf / "snakemake.out").read_text(), mini_rc=mini.returncode,
                           mini_out=mini_out.read_text(), requeued=requeued, crashed=crashed, squeue=jobs,
                           t_slurm=t_slurm, t_all=time.time() - t0)


def _metrics(wf: Path, variant: str) -> list[dict]:
    path = wf / f"results/{SWEEP}/runs/{MODEL}/{variant}/seed0/metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def _run(wf: Path, variant: str) -> dict:
    return json.loads((wf / f"results/{SWEEP}/runs/{MODEL}/{variant}/seed0/run.json").read_text())


def test_the_sweep_runs_through_the_slurm_profile_and_equals_a_local_run(sweep):
    print(f"\nSLURM sweep {sweep.t_slurm:.0f} s, all three runs {sweep.t_all:.0f} s")
    assert sweep.rc == 0, sweep.out[-4000:]
    assert sweep.local_rc == 0, sweep.local_out[-3000:]
    # every job but the local rules (aggregate, figures, all: cheap, on the submit host) went through sbatch
    submitted = re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+)", sweep.out)
    local_rules = set(re.findall(r"^localrule (\w+):", sweep.out, re.M))
    assert local_rules == {"aggregate", "figures", "all"}, local_rules
    remote_rules = re.findall(r"^rule (\w+):", sweep.out, re.M)
    assert sorted(set(remote_rules)) == ["attribute", "make_tiny", "pretrain_tiny", "probe", "train"]
    # 7 jobs, each submitted once: the requeued job kept its SLURM job; the crashed command was retried inside
    # its job (rule-level `retries` also apply within the job step)
    assert len(submitted) == len(remote_rules) == 7
    for path in (f"results/{SWEEP}/aggregate/runs.csv", f"results/{SWEEP}/aggregate/probe.csv",
                 f"results/{SWEEP}/probe/{MODEL}/vllm-eager.csv", f"figures/{SWEEP}/fig_reward.png",
                 f"results/{SWEEP}/attribution/{MODEL}/vllm-eager/attribution.csv",
                 f"figures/{SWEEP}/fig_attribution.png",
                 f"figures/{SWEEP}/fig_probe.pdf", f"figures/{SWEEP}/summary.md"):
        assert (sweep.slurm_wf / path).is_file(), path
    for variant in VARIANTS:
        slurm_rows, local_rows = _metrics(sweep.slurm_wf, variant), _metrics(sweep.local_wf, variant)
        assert len(slurm_rows) == 16, variant
        assert slurm_rows == local_rows, variant
        assert _run(sweep.slurm_wf, variant)["status"] == "done"


def test_a_preempted_training_job_is_requeued_resumes_and_matches_an_uninterrupted_run(sweep):
    assert sweep.requeued, "the `full` training job finished before it could be requeued"
    run = _run(sweep.slurm_wf, "full")
    assert run["resumed_from"], run
    log = (sweep.slurm_wf / f"logs/{SWEEP}/train/{MODEL}/full/seed0.log").read_text()
    assert "resuming from checkpoint-" in log
    # SLURM restarted the same job (same id): Snakemake submitted `full` once
    assert [line.split("|")[3] for line in sweep.squeue.splitlines()].count(_comment("full")) == 1
    checkpoints = sorted(p.name for p in (sweep.run_dir["full"] / "checkpoints").glob("checkpoint-*"))
    assert checkpoints and "checkpoint-16" in checkpoints, checkpoints
    assert _metrics(sweep.slurm_wf, "full") == _metrics(sweep.local_wf, "full")


def _submissions(out: str, rule: str) -> list[int]:
    return [m.start() for m in re.finditer(rf"has been submitted with SLURM jobid \d+ \(log: \S*/rule_{rule}/", out)]


def test_a_job_over_its_time_limit_is_retried_with_the_longer_limit_and_ends(sweep):
    out = sweep.mini_out
    assert re.search(r"SLURM-job '\d+' failed, SLURM status is: 'TIMEOUT'", out), out[-4000:]
    assert len(_submissions(out, "slow")) == 2
    # attempt 2 ran under runtime 2 (minutes): SLURM's own record of its time limit
    assert (sweep.mini_wf / "limit.txt").read_text().strip() == "2:00"


def test_a_failing_command_loses_no_checkpoint_and_the_sweep_goes_on(sweep):
    out = sweep.mini_out
    # `broken` failed on all 3 attempts (profile: retries 2) and each attempt's checkpoint is still there
    broken = _submissions(out, "broken")
    assert len(broken) == 3, out[-4000:]
    assert len(list((sweep.mini_wf / "work/broken").glob("checkpoint-*"))) == 3
    assert not (sweep.mini_wf / "broken.txt").exists()
    # keep-going: `later` was submitted after the last failure of `broken` and ran; the run as a whole failed
    last_failure = [m.start() for m in re.finditer(r"Error in rule broken", out)][-1]
    assert last_failure > broken[-1] and _submissions(out, "later")[0] > last_failure
    assert (sweep.mini_wf / "later.txt").is_file() and sweep.mini_rc != 0


def test_a_crashed_training_command_resumes_from_its_checkpoint(sweep):
    assert sweep.crashed, "the `rope` training job finished before it could be killed"
    # the job step saw the command fail (137) and retried it within the same SLURM job
    slurm_logs = list((sweep.slurm_wf / f"logs/slurm/rule_train/{SWEEP}_{MODEL}_rope_0").glob("*.log"))
    assert len(slurm_logs) == 1 and "Error in rule train" in slurm_logs[0].read_text()
    run = _run(sweep.slurm_wf, "rope")
    assert run["status"] == "done" and run["resumed_from"], run
    # the retry resumed from a checkpoint that was there when the command died
    log = (sweep.slurm_wf / f"logs/{SWEEP}/train/{MODEL}/rope/seed0.log").read_text()
    resumed = re.search(r"resuming from (checkpoint-\d+)", log).group(1)
    assert resumed in sweep.crashed["checkpoints"], (resumed, sweep.crashed)
    assert _metrics(sweep.slurm_wf, "rope") == _metrics(sweep.local_wf, "rope")


def test_a_job_killed_while_saving_resumes_from_the_last_complete_checkpoint(sweep):
    assert (sweep.slurm_wf / "fault-fired").is_file(), "the fault in the save of `baseline` never fired"
    run = _run(sweep.slurm_wf, "baseline")
    assert run["status"] == "done", run
    assert [r["checkpoint"] for r in run["incomplete_checkpoints"]] == ["checkpoint-8"], run
    log = (sweep.slurm_wf / f"logs/{SWEEP}/train/{MODEL}/baseline/seed0.log").read_text()
    assert "checkpoint-8 is incomplete" in log and "resuming from checkpoint-4" in log, log[-3000:]
    assert (sweep.run_dir["baseline"] / "checkpoints/incomplete/checkpoint-8").is_dir()  # set aside, kept
    assert _metrics(sweep.slurm_wf, "baseline") == _metrics(sweep.local_wf, "baseline")


def test_the_profile_needs_only_environment_variables_and_no_account(sweep):
    # the profile used is the repository's, byte for byte, with SLURM_ACCOUNT and SLURM_PARTITION unset
    assert (sweep.slurm_wf / "workflow/profiles/slurm/config.yaml").read_bytes() == \
        (ROOT / "workflow/profiles/slurm/config.yaml").read_bytes()
    assert "SLURM_ACCOUNT" not in sweep.env and "SLURM_PARTITION" not in sweep.env
    assert "$SLURM" not in sweep.out
    ours = [line.split("|") for line in sweep.squeue.splitlines() if "|rule_" in line]
    assert ours
    for jobid, account, partition, *_ in ours:
        assert "$" not in account and account in ("", "(null)"), (jobid, account)
        assert partition == "debug", (jobid, partition)  # the cluster's default partition


def test_slurm_up_is_idempotent_and_status_answers(sweep):
    script = ROOT / "tools/cluster/slurm_local.sh"
    if os.geteuid() != 0 or not (SLURM_DIR / "pids").is_file():
        pytest.skip("the cluster was not started by tools/cluster/slurm_local.sh as this user")
    res = subprocess.run([str(script), "up"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "already up" in res.stdout, res.stdout + res.stderr
    assert subprocess.run([str(script), "status"], capture_output=True, text=True).returncode == 0
