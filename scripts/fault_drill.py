"""The fault drill: each fault a cluster deals out, injected into a real run of the debug model
on this machine (gloo, CPU), and what titanlite did about it, measured:

    python scripts/fault_drill.py                  # 2 ranks; --ranks 4 for 4
    python scripts/fault_drill.py --only kill stop

Faults (scripts/fault_inject.py injects them as step 5 starts; checkpoints every 2 steps):
- kill: rank 1 SIGKILLed; stop: rank 1 SIGSTOPped (hung). Both under `torchrun --max-restarts
  1`: detected = the peer's one-line error, back = the restarted job's first step;
- junk: a batch of random tokens on every rank at step 7, with the loss spike guard on
  (skip);
- full: the disk fills during a save (a 100 MiB tmpfs; needs root to mount, else left out);
- bad: malformed JSON lines in a local corpus (lines 30 and 100), once read whole into the token
  cache (the default: the first stops the run), once streamed with
  --training.dataset_max_bad_rows 1 (the first skipped and counted, the second stops it);
- bitflip: after a finished run, one bit flipped in rank 1's file of its last checkpoint; the
  rerun (detected = from its launch to its one-line error), then the rerun with the step it
  names (back = its first step after resuming).
- shrink: two nodes of ranks/2 workers in torchrun's elastic range (--nnodes 1:2, a fresh store
  per group, 1 s rendezvous timeouts, 16 steps): as step 5 starts one node dies (its agent and
  workers SIGKILLed; detected = the peer's error, back = the first step of the smaller group);
  once that group trains, the node's agent starts again (detected = the group's stop, back = its
  first step with the node back).
Times are seconds from the fault (the moment the injector wrote down; for bad data, the launch)
to what followed, read from the run's output as it arrives. Prints a Markdown table.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = ["--job.config_file", "debug_model.toml", "--model.vocab_limit", "512",
       "--training.seq_len", "32", "--training.local_batch_size", "2",
       "--training.global_batch_size", "8", "--training.mixed_precision_param", "float32",
       "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
       "--no-metrics.enable_tensorboard", "--metrics.peak_tflops", "1",
       "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2"]  # fmt: skip
FAULT_STEP = 5
JUNK_STEP = 7  # after six steps on short documents, whose loss falls fast
# The dead node's heartbeats lapse after 4 s, then the group re-forms 1 s later (torch: 15 + 30).
ELASTIC_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4"


def watch(cmd: list, patterns: dict) -> tuple[int, dict, str]:
    """Run `cmd`; (exit code, arrival time of a line matching each pattern, output): the first
    one, or the last for a name starting with "last"."""
    seen, out = {}, []
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    for line in proc.stdout:
        out.append(line)
        for name, pattern in patterns.items():
            if (name not in seen or name.startswith("last")) and re.search(pattern, line):
                seen[name] = time.time()
    return proc.wait(), seen, "".join(out)


def lost_rank(how: str, ranks: int, timeout: int, dump: Path) -> list:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--max-restarts", "1", "scripts/fault_inject.py", how, str(FAULT_STEP), *RUN,
           "--comm.train_timeout_seconds", str(timeout),
           "--job.dump_folder", str(dump)]  # fmt: skip
    code, seen, out = watch(cmd, {
        "detected": r"a collective failed", "restarted": r"training from step \d+",
        "back": rf"INFO step +{FAULT_STEP} ",
    })  # fmt: skip
    fault = float((dump / "fault_at").read_text())
    resumed = re.findall(r"training from step (\d+)", out)[-1]
    lost = FAULT_STEP - 1 - int(resumed)  # completed steps that were not saved
    what = ("a peer logs the step and the backend's reason, exits 4; torchrun restarts the "
            f"group, which resumes from step {resumed} (exit {code})")  # fmt: skip
    detect = seen["detected"] - fault
    back = seen["back"] - fault if "back" in seen else float("nan")
    return [f"rank 1 {'SIGKILLed' if how == 'kill' else 'SIGSTOPped (hung)'}, {ranks} ranks",
            what, f"{detect:.1f} s (back training after {back:.1f} s)",
            f"{lost} completed step(s), and the step in progress"]  # fmt: skip


def junk(ranks: int, dump: Path) -> list:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "scripts/fault_inject.py", "junk", str(JUNK_STEP), *RUN,
           "--training.loss_spike_factor", "2", "--training.loss_spike_window", "3",
           "--training.on_loss_spike", "skip", "--training.dataset", "local",
           "--training.dataset_path", str(short_docs(dump.parent)),
           "--job.dump_folder", str(dump)]  # fmt: skip
    code, seen, out = watch(cmd, {"detected": r"loss spike at step"})
    fault = float((dump / "fault_at").read_text())
    line = re.search(r"loss spike at step \d+: loss \S+ is \S+x", out)
    return [f"a batch of random tokens on every rank, {ranks} ranks",
            f"'{line.group(0) if line else 'no report'} ...' with the data it trained on; the "
            f"update skipped on every rank (exit {code})",
            f"{seen['detected'] - fault:.1f} s (the same step)" if "detected" in seen else "-",
            "nothing: the step's update is not taken"]  # fmt: skip


def short_docs(folder: Path) -> Path:
    """Documents of 3-20 tokens from 8 words (the parity tests' too): a 32-token row packs
    several, and the loss falls fast, so random tokens stand out."""
    corpus = folder / "short_docs.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "x", "y", "return", "if"]
    lines = [" ".join(words[(i + j) % 8] for j in range(3 + i % 17)) for i in range(400)]
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return corpus


BAD_LINES = (30, 100)


def bad_rows(dump: Path) -> list:
    corpus = dump.parent / "bad_docs.jsonl"
    lines = short_docs(dump.parent).read_text().splitlines(keepends=True)
    for n in BAD_LINES:
        lines[n - 1] = '{"text": "cut short\n'
    corpus.write_text("".join(lines))
    cmd = [sys.executable, "train.py", *RUN, "--training.dataset", "local",
           "--training.dataset_path", str(corpus),
           "--training.data_cache_dir", str(dump / "c")]  # fmt: skip
    skip = ["--training.dataset_streaming", "--training.dataset_max_bad_rows", "1"]
    said, times = [], []
    # From the data's first read (the cache is built) or the last step before the one whose
    # rows reach the bad line.
    for name, extra, since in (("cache", [], r"INFO tokenizing "), ("stream", skip, r"INFO step ")):
        code, seen, out = watch([*cmd, *extra, "--job.dump_folder", str(dump / name)],
                                {"last": since, "detected": r"titanlite: error: "})  # fmt: skip
        logged = re.findall(r"INFO step +(\d+) .*skipped_rows (\d+)", out)
        line = re.search(r"^titanlite: error: \S+?(:\d+: not valid JSON).*?(: bad row .*)?$",
                         out, re.M)  # fmt: skip
        counted = f", after steps logging skipped_rows {logged[0][1]}" if logged else ""
        said.append(f"'{line.group(1)} ...{line.group(2) or ''}'{counted}; exit {code}"
                    if line else f"no error; exit {code}")  # fmt: skip
        when = f"in step {int(logged[-1][0]) + 1}" if logged else "from reading the data"
        times.append(f"{seen['detected'] - seen['last']:.1f} s ({when})")
    return [f"malformed JSON at lines {BAD_LINES[0]} and {BAD_LINES[1]} of a local corpus, "
            "1 process: read into the token cache / streamed with max_bad_rows 1",
            " / ".join(said), " / ".join(times),
            "nothing: no step trains on a bad row"]  # fmt: skip


def full_disk(dump: Path) -> list | None:
    dump.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(dump)],
                      capture_output=True).returncode:  # fmt: skip
        return None
    try:
        cmd = [sys.executable, "train.py", *RUN, "--job.dump_folder", str(dump)]
        start = time.time()
        code, seen, out = watch(
            cmd, {"warned": r"needs about", "detected": r"could not be written"}
        )
        kept = sorted(p.name for p in (dump / "checkpoint").iterdir())
    finally:
        subprocess.run(["umount", str(dump)], check=True)
    line = re.search(r"checkpoint step \d+ could not be written to \S+ it needs about [^)]*\)", out)
    return ["the disk fills during a save (100 MiB tmpfs, 64 MiB checkpoints)",
            f"a warning before the save, then '{line.group(0) if line else 'no error'}'; exit "
            f"{code}", f"{seen['detected'] - seen['warned']:.1f} s after the warning "
            f"({seen['detected'] - start:.1f} s into the run)",
            f"nothing saved: kept {', '.join(kept)}; the steps since it"]  # fmt: skip


def bitflip(ranks: int, dump: Path) -> list:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
              "train.py", *RUN, "--job.dump_folder", str(dump)]  # fmt: skip
    code, _, out = watch(launch, {})
    if code:
        raise RuntimeError(f"the run to damage failed (exit {code}):\n{out[-3000:]}")
    last = dump / "checkpoint" / "step-8"
    victim = last / f"__{ranks - 1}_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    rerun = [*launch, "--training.steps", "10"]
    start = time.time()
    code, seen, out = watch(rerun, {"detected": r"is damaged"})
    said = re.search(r"error: (checkpoint \S+ is damaged: \S+: [^;]*; .*)", out)
    good = re.search(r"load_step (\d+)", said.group(1)) if said else None
    if good is None:
        return [f"a bit flipped in a checkpoint, {ranks} ranks", f"not detected (exit {code})",
                "-", "-"]  # fmt: skip
    back_code, back, _ = watch(
        [*rerun, "--checkpoint.load_step", good.group(1)], {"back": r"training from step"}
    )
    return [f"a bit flipped in rank {ranks - 1}'s file of the last checkpoint (step 8), "
            f"{ranks} ranks", f"the rerun stops before building the model: '{said.group(1)}', "
            f"exit {code}; rerun as it says, it resumes (exit {back_code})",
            f"{seen['detected'] - start:.1f} s after the rerun's launch, before any step",
            f"the {8 - int(good.group(1))} steps since step {good.group(1)}"]  # fmt: skip


class Agent:
    """A torchrun agent of the elastic drill, its output lines timed as they arrive."""

    def __init__(self, cmd: list, env: dict):
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        self.lines, self.seen = [], 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def next(self, pattern: str, timeout: float = 300) -> float:
        """When the next line matching `pattern` (after the last one matched) arrived."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for i in range(self.seen, len(self.lines)):
                if re.search(pattern, self.lines[i][1]):
                    self.seen = i + 1
                    return self.lines[i][0]
            time.sleep(0.05)
        raise RuntimeError(f"no {pattern!r} within {timeout} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def kill_node(self) -> None:
        """SIGKILL the agent and its workers at once, as a node dies."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        self.proc.kill()
        for pid in map(int, out.stdout.split()):
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def shrink(ranks: int, timeout: int, dump: Path) -> list:
    node = max(ranks // 2, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def agent(host: bool) -> Agent:
        conf = f"{ELASTIC_CONF},is_host={host:d}"
        return Agent([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                      "--nproc_per_node", str(node), "--max-restarts", "3", "--rdzv_backend",
                      "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "drill",
                      "--rdzv_conf", conf, "train.py", *RUN, "--training.steps", "16",
                      "--comm.train_timeout_seconds", str(timeout),
                      "--job.dump_folder", str(dump)], env)  # fmt: skip

    first, second = agent(True), agent(False)  # the first hosts the rendezvous and stays
    first.next(rf"Saved checkpoint \S+step-{FAULT_STEP - 1}")  # as step 5 starts
    killed = time.time()
    second.kill_node()
    detected, back = first.next(r"a collective failed"), first.next(r"INFO step ")
    resumed = re.findall(r"training from step (\d+)", first.output())[-1]
    joined, third = time.time(), agent(False)
    stopped, _ = first.next(r"Got signal 15"), first.next(r"training from step")
    regrown = first.next(r"INFO step ")
    codes = first.proc.wait(), third.proc.wait()
    saved = re.findall(r"saved step (\d+), exiting", first.output())[-1]
    return [[f"a node of {node} rank(s) SIGKILLed (agent and workers), 2 nodes in "
             "`--nnodes 1:2`", "a peer logs the step and exits 4; torchrun re-forms the job on "
             f"the node left, which resumes from step {resumed}",
             f"{detected - killed:.1f} s; training again on {node} rank(s) after "
             f"{back - killed:.1f} s",
             f"{FAULT_STEP - 1 - int(resumed)} completed step(s), and the step in progress"],
            [f"the node's agent started again, {node} rank(s) training",
             f"torchrun stops the group (SIGTERM: it saves step {saved}); {2 * node} ranks "
             f"resume from it (exit {codes[0]}, {codes[1]})",
             f"{stopped - joined:.1f} s from the agent's start; training on {2 * node} ranks "
             f"after {regrown - joined:.1f} s", "nothing: the group saves as it stops"],
            ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--train_timeout", type=int, default=10, help="comm.train_timeout_seconds")
    faults = ["kill", "stop", "junk", "full", "bad", "bitflip", "shrink"]
    ap.add_argument("--only", nargs="+", default=faults, choices=faults)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fault_drill_") as tmp:
        for name in a.only:
            dump = Path(tmp) / name
            if name in ("kill", "stop"):
                rows.append(lost_rank(name, a.ranks, a.train_timeout, dump))
            elif name == "junk":
                rows.append(junk(a.ranks, dump))
            elif name == "bad":
                rows.append(bad_rows(dump))
            elif name == "bitflip":
                rows.append(bitflip(a.ranks, dump))
            elif name == "shrink":
                rows += shrink(a.ranks, a.train_timeout, dump)
            elif (row := full_disk(dump)) is not None:
                rows.append(row)
            else:
                print("full: left out (cannot mount a tmpfs here)", file=sys.stderr)
            shutil.rmtree(dump, ignore_errors=True)
    print("| fault | what titanlite does | time to detect | what is lost |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
