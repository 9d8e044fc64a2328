"""Failures of a distributed run end every rank within 60 s with an error that names the rank, instead of hanging
(issue 12 item 8): a load that fails on one rank, ranks that loaded different models, a rank killed or frozen
mid-generation; and ranks that finish at different times raise no alarm.

Load checks run under ``mlx.launch`` (as CI and users run it) or by hand with the environment the launcher gives the
ranks; the watchdog checks run by hand only: the launcher itself kills the other ranks as soon as one exits
non-zero, which would race the watchdog under test, and the watchdog exists for the runs where nothing else ends them
(a frozen rank, a host that went away, other launchers). Every run has a subprocess timeout, so a hang fails the test
instead of hanging CI.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import KL_FIXTURE
from distributed import PREAMBLE, _free_port_base, run_ranks

from kimi_mlx.parallel.health import agree, differences, fingerprint

LIMIT_S = 60  # the bound for every rank to exit
HANG_S = 120  # subprocess timeout

# Each rank opens the model directory given for it, then reads its weights: the two steps of loading, each agreed on
# by every rank (as in load(parallel=...)), with the watchdog running.
LOAD = """
import sys
from pathlib import Path
from mlx.utils import tree_flatten
from kimi_mlx.loading import load_model
from kimi_mlx.parallel.health import RankError, agree, fingerprint
from kimi_mlx.parallel.watchdog import watch

watch(group)
path = Path(sys.argv[1 + group.rank()])
try:
    with agree(group, "opening the model") as step:
        model, _ = load_model(path, lazy=True)
        step.fingerprint = fingerprint(json.loads((path / "config.json").read_text()),
                                       [(k, v.shape, v.dtype) for k, v in tree_flatten(model.parameters())],
                                       sorted(path.glob("*.safetensors")))
    with agree(group, "loading the weights"):
        mx.eval(model.parameters())
except RankError:
    sys.exit(2)  # rank 0 has printed the error; the others stay silent
report("loaded")
"""

# A generation-like loop of collectives under the watchdog; rank VICTIM kills (or freezes) itself in the middle.
LOOP = """
import signal, time
from kimi_mlx.parallel.watchdog import watch

victim, how, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
watch(group)
logits = mx.ones((1, 512))
for step in range(steps):
    mx.eval(mx.distributed.all_sum(logits, group=group))
    if step == 20 and group.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
time.sleep([0.3, 0.0, 2.5][group.rank()])  # finish at different times, one idle for longer than the timeout
report("done")
"""


def run_by_hand(code: str, n: int, tmp_path: Path, args=(), env=None, wait_for=None, stderr_gone=False):
    """Start ``n`` ranks with the environment ``mlx.launch`` gives them (``MLX_RANK``, ``MLX_HOSTFILE``), each
    pinned to a core, but no launcher; wait for the ranks ``wait_for`` (default all) to exit, then kill the rest.
    ``stderr_gone``: each rank's stderr is a pipe nobody reads any more (a launcher that was killed).
    Returns (exit status per rank, stderr per rank, seconds until the awaited ranks had exited)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "rank_script.py"
    script.write_text(PREAMBLE + textwrap.dedent(code))
    base = _free_port_base(n)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(n)]))
    procs = []
    start = time.monotonic()
    try:
        for r in range(n):
            rank_env = dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), KIMI_RANK_OUT=str(tmp_path),
                            **(env or {}))
            err = subprocess.PIPE if stderr_gone else open(tmp_path / f"rank{r}.err", "w")
            procs.append(subprocess.Popen(
                ["taskset", "-c", str(r % (os.cpu_count() or 1)), sys.executable, str(script), *map(str, args)],
                env=rank_env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err))
            if stderr_gone:
                procs[-1].stderr.close()
                (tmp_path / f"rank{r}.err").write_text("")
        for r in range(n) if wait_for is None else wait_for:
            procs[r].wait(timeout=max(HANG_S - (time.monotonic() - start), 1))
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], [(tmp_path / f"rank{r}.err").read_text() for r in range(n)], elapsed


def sharded_copy(src: Path, dst: Path) -> Path:
    """``src`` (one model.safetensors) as a two-shard checkpoint with an index, in ``dst``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = mx.load(str(src / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        mx.save_safetensors(str(dst / file), {k: weights[k] for k in keys})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


# --------------------------------------------------------------------------------------------- in-process checks


def test_differences_name_the_ranks_and_what_differs(tmp_path):
    tensors = [("model.layers.0.mlp.weight", (4, 8), mx.float32), ("lm_head.weight", (16, 4), mx.float32)]
    base = fingerprint({"hidden_size": 4, "rms_norm_eps": 1e-5}, tensors)
    other = fingerprint({"hidden_size": 4, "rms_norm_eps": 1e-6}, [tensors[0], ("lm_head.weight", (16, 4), mx.bfloat16)])
    assert differences([base, base, other], ["a", "b", "c"]) == [
        "config 'rms_norm_eps': ranks 0 (a), 1 (b): 1e-05; rank 2 (c): 1e-06",
        f"tensors 'lm_head': ranks 0 (a), 1 (b): {base['tensors']['lm_head']}; rank 2 (c): "
        f"{other['tensors']['lm_head']}",
    ]
    assert re.fullmatch(r"1 tensor \(float32 1\), sha256 [0-9a-f]{16}", base["tensors"]["lm_head"])
    assert other["tensors"]["lm_head"].startswith("1 tensor (bfloat16 1), sha256 ")
    assert differences([base, {}], ["a", "b"])[0] == "config 'hidden_size': rank 0 (a): 4; rank 1 (b): (missing)"
    for host, content in [("a", b"x" * 100), ("b", b"x" * 99 + b"y")]:  # same name and size, other bytes
        (tmp_path / host).mkdir()
        (tmp_path / host / "model.safetensors").write_bytes(content)
    prints = [fingerprint({}, [], [tmp_path / host / "model.safetensors"]) for host in "ab"]
    assert [line.split(": ", 1)[0] for line in differences(prints, ["a", "b"])] == ["files 'model.safetensors'"]
    assert prints[0]["files"]["model.safetensors"].startswith("100 bytes, sample sha256 ")


def test_a_single_process_step_raises_its_own_error():
    with pytest.raises(FileNotFoundError):
        with agree(mx.distributed.init(), "opening the model"):  # a group of one: no collective, no RankError
            raise FileNotFoundError("x")


# --------------------------------------------------------------------------------------------- launched checks


def test_a_load_failing_on_one_rank_ends_every_rank_with_its_error(tmp_path):
    complete = sharded_copy(KL_FIXTURE / "hf", tmp_path / "complete")
    missing = shutil.copytree(complete, tmp_path / "missing")
    (missing / "model-00002-of-00002.safetensors").unlink()  # rank 1's host lacks a shard
    start = time.monotonic()
    proc = run_ranks(LOAD, 2, tmp_path / "run", args=(complete, missing), timeout=HANG_S, check=False)
    assert time.monotonic() - start < LIMIT_S
    out = proc.stdout + proc.stderr
    # mlx.launch itself exits 0 whatever the ranks do; it warns about each rank that exited non-zero or was killed
    ended = dict(re.findall(r"Node with rank (\d+) (exited with code -?[1-9]\d*|was killed)", out))
    assert sorted(ended) == ["0", "1"], out
    error = (f"kimi-mlx: error: opening the model failed on rank 1 ({os.uname().nodename}): CheckpointError: "
             f"{missing / 'model.safetensors.index.json'}: lists shard(s) not present in {missing}: "
             "['model-00002-of-00002.safetensors']")
    assert error in out and out.count("kimi-mlx: error:") == 1, out  # printed by rank 0 only


def test_ranks_that_loaded_different_configs_are_refused(tmp_path):
    fixture = KL_FIXTURE / "hf"
    changed = shutil.copytree(fixture, tmp_path / "changed")
    (changed / "config.json").chmod(0o644)
    config = json.loads((fixture / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-6)))
    status, errors, elapsed = run_by_hand(LOAD, 2, tmp_path / "run", args=(fixture, changed))
    assert status == [2, 2] and elapsed < LIMIT_S, errors
    host = os.uname().nodename
    assert (f"kimi-mlx: error: the ranks loaded different models (opening the model); give every rank the same "
            f"files:\n  config 'rms_norm_eps': rank 0 ({host}): 1e-05; rank 1 ({host}): 1e-06\n") in errors[0]
    assert errors[1] == ""


@pytest.mark.parametrize("n, victim, how", [(3, 1, "kill"), (2, 0, "kill"), (2, 1, "stop")],
                         ids=["rank1-of-3-killed", "rank0-killed", "rank1-frozen"])
def test_a_lost_rank_ends_the_others_naming_it(tmp_path, n, victim, how):
    survivors = [r for r in range(n) if r != victim]
    status, errors, elapsed = run_by_hand(LOOP, n, tmp_path, args=(victim, how, 10**6),
                                          env={"KIMI_MLX_PEER_TIMEOUT": "3"}, wait_for=survivors)
    assert elapsed < LIMIT_S
    why = ("no heartbeat for 3 s (KIMI_MLX_PEER_TIMEOUT)" if how == "stop" else
           "its connection closed without a goodbye (process killed or crashed, or host down)")
    for r in survivors:
        assert status[r] == 1, errors[r]
        assert f"kimi-mlx: error: rank {victim} ({os.uname().nodename}) lost: {why}\n" in errors[r], errors[r]


def test_a_lost_rank_ends_the_others_when_their_stderr_is_gone(tmp_path):
    """The launcher is gone (killed with its process group), so writing the error fails: a rank whose peer froze
    still ends with status 1 instead of staying blocked in a collective forever."""
    status, _, elapsed = run_by_hand(LOOP, 2, tmp_path, args=(1, "stop", 10**6), env={"KIMI_MLX_PEER_TIMEOUT": "3"},
                                     wait_for=[0], stderr_gone=True)
    assert elapsed < LIMIT_S and status[0] == 1


def test_ranks_that_finish_at_different_times_raise_no_alarm(tmp_path):
    env = {"KIMI_MLX_PEER_TIMEOUT": "2", "KIMI_MLX_COORDINATOR": "127.0.0.1"}  # rank 0's address given, port free
    status, errors, _ = run_by_hand(LOOP, 3, tmp_path, args=(-1, "none", 50), env=env)
    assert status == [0, 0, 0] and errors == ["", "", ""], errors
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)] == ["done"] * 3
