"""Fault injection on real `frenzy run` processes (CPU, tiny GPT-2, real accelerate launch, the
embedded Prefect server unless a scenario says otherwise): each scenario starts a run, injects
one fault mid-training and reports

* gpus_freed: no ledger allocation of the run left active at the end (for a submitter killed
  outright: its lease is no longer renewed and runs out within the TTL, after which the ledger
  frees it; the bench then expires it at that moment); null for a scenario that did not run
  (db-outage without FRENZY_TEST_POSTGRES_URL: its row says skipped, neither ok nor RED),
* steps_lost: steps trained but not in a checkpoint when the fault hit (what a resume redoes),
* status: how the run ended (the result's status, else from the exit status),
* leftover_processes: processes of the run (the CLI, the embedded server, the launcher, the
  ranks; found by an environment marker all of them inherit) alive 15 s after the end.

    python bench/faults.py [--json] [--only NAME,...] [--steps 400] [--checkpoint-every 25]

Scenarios: kill9-submitter, kill9-rank, kill9-server, server-restart (a dedicated `prefect
server` restarted mid-run), db-outage (the PostgreSQL ledger refuses connections for 20 s;
needs FRENZY_TEST_POSTGRES_URL), clock-skew (another process expires leases with a clock
301 s ahead), lease-lost (the run's lease runs out and is reaped: the run must stop, fenced),
readonly-runs (the runs folder cannot be created), sigterm. With ``--json`` the last line is
``{"scenarios": [{"name", "gpus_freed", "steps_lost", "status", "leftover_processes"}, ...]}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from trainer.ports import free_port  # noqa: E402

MARKER = "FRENZY_BENCH_MARKER"
# after the end, how long processes get to go away (the ranks poll their parent every 2 s)
SETTLE_S = 15.0
# a run must reach the fault step within this (Prefect start-up + launch on a busy 2-core box)
START_TIMEOUT_S = 240.0
END_TIMEOUT_S = 240.0
LEASE_TTL_S = 300.0          # the ledger's default lease (ledger.core.DEFAULT_LEASE_S)
STEP = re.compile(r"FRENZY_STEP (\{.*\})")
CKPT = re.compile(r"FRENZY_CHECKPOINT (\{.*\})")


def job_yaml(steps: int, every: int) -> str:
    return (f"name: faults\nmodel: gpt2-tiny\nseq_len: 64\nglobal_batch: 8\ntrain_steps: {steps}\n"
            f"precision: fp32\noptimizer: adamw\nlr: 0.003\ncheckpoint_every: {every}\ndata:\n  kind: synthetic\n")


class Run:
    """One `frenzy run --json` in a folder of its own (its FRENZY_HOME inside)."""

    def __init__(self, base: Path, name: str, args, *, env: dict | None = None, extra: list[str] = (),
                 prepare=None):
        self.dir = base / name
        self.dir.mkdir(parents=True)
        self.home = self.dir / ".frenzy"
        if prepare is not None:
            prepare(self.home)
        self.marker = uuid.uuid4().hex
        (self.dir / "job.yaml").write_text(job_yaml(args.steps, args.checkpoint_every))
        e = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FRENZY_"))}
        e.update(PYTHONPATH=str(ROOT), PREFECT_SERVER_ANALYTICS_ENABLED="false", FRENZY_HOME=str(self.home),
                 PREFECT_HOME=str(base / "prefect-home"), **{MARKER: self.marker})
        e.update(env or {})
        self.env = e
        self.err = open(self.dir / "stderr.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "frenzy_cli.main", "run", "job.yaml", "--json", *extra],
                                     cwd=self.dir, env=e, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     start_new_session=True)
        self.t0 = time.monotonic()
        self.out = ""

    # ---------------------------------------------------------------- progress
    def lines(self) -> list[str]:
        out = []
        for log in sorted(self.home.glob("runs/*/attempt-*.log")):
            try:
                out += log.read_text(errors="replace").splitlines()
            except OSError:
                pass
        return out

    def last_step(self) -> int:
        steps = [json.loads(m.group(1))["step"] for l in self.lines() if (m := STEP.search(l))]
        return max(steps, default=0)

    def checkpoint_step(self) -> int:
        steps = [int(p.parent.name.split("-")[1]) for p in self.home.glob("runs/*/checkpoints/step-*/frenzy_ckpt.json")]
        return max(steps, default=0)

    def wait_step(self, n: int, timeout_s: float = START_TIMEOUT_S) -> int:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            s = self.last_step()
            if s >= n:
                return s
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run ended ({self.proc.returncode}) before step {n}: "
                                   f"{(self.dir / 'stderr.log').read_text()[-1500:]}")
            time.sleep(0.2)
        raise RuntimeError(f"step {n} not reached within {timeout_s:.0f} s")

    def fault_point(self) -> tuple[int, int]:
        """(last step trained, newest checkpoint) right now."""
        return self.last_step(), self.checkpoint_step()

    # ---------------------------------------------------------------- processes
    def processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(MARKER) == self.marker:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def find(self, needle: str, but: str | None = None) -> psutil.Process | None:
        for p in self.processes():
            try:
                cmd = " ".join(p.cmdline())
                if needle in cmd and (but is None or but not in cmd):
                    return p
            except psutil.Error:
                pass
        return None

    def wait_end(self, timeout_s: float = END_TIMEOUT_S) -> int | None:
        try:
            self.out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return self.proc.returncode

    def leftovers(self) -> int:
        end = time.monotonic() + SETTLE_S
        while time.monotonic() < end and self.processes():
            time.sleep(0.5)
        left = self.processes()
        for p in left:                       # clean up for the next scenario
            try:
                p.kill()
            except psutil.Error:
                pass
        return len(left)

    def result(self) -> dict:
        try:
            return json.loads(self.out.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return {}

    def status(self, rc: int | None) -> str:
        doc = self.result()
        if doc.get("status"):
            return str(doc["status"])
        return "hung" if rc is None else f"exit {rc}"

    # ---------------------------------------------------------------- ledger
    def ledger(self, url: str | None = None):
        from ledger import Ledger

        return Ledger(url or f"sqlite:///{self.home / 'ledger.db'}")

    def active(self, url: str | None = None) -> list:
        try:
            return self.ledger(url).allocations(active_only=True)
        except Exception:
            return []


def row(name: str, gpus_freed: bool | None, lost: int, status: str, left: int, note: str = "") -> dict:
    """One scenario's outcome; ``gpus_freed`` None: the scenario did not run (skipped)."""
    return {"name": name, "gpus_freed": None if gpus_freed is None else bool(gpus_freed), "steps_lost": int(lost),
            "status": status, "leftover_processes": int(left), "_note": note}


# ------------------------------------------------------------------------- scenarios
def kill9_submitter(base, args):
    r = Run(base, "kill9-submitter", args)
    r.wait_step(3 * args.checkpoint_every)
    held = r.active()
    step, ck = r.fault_point()
    killed_at = time.time()
    r.proc.kill()
    rc = r.wait_end(30)
    left = r.leftovers()
    active = r.active()
    # nobody renews a dead submitter's lease: it runs out within one TTL of the kill
    expires = [a.lease_expires_at for a in active]
    within = bool(held) and all(e <= killed_at + LEASE_TTL_S for e in expires)
    time.sleep(3)
    renewed = any(a.lease_expires_at != e for a, e in zip(r.active(), expires))
    # the ledger's expiry (its own clock) frees it then; the bench does not wait the TTL out
    ok = within and not renewed
    for a in active:
        r.ledger().release(a.id)
    return row("kill9-submitter", ok, step - ck, r.status(rc), left,
               f"lease ran out {max(expires) - killed_at:.0f} s after the kill" if expires else "nothing held")


def kill9_rank(base, args):
    r = Run(base, "kill9-rank", args)
    r.wait_step(3 * args.checkpoint_every)
    rank = r.find("-m trainer.train", but="bound_launch")     # a rank, not its launcher
    step, ck = r.fault_point()
    if rank is not None:
        rank.kill()
    rc = r.wait_end()
    doc = r.result()
    resumed = [a.get("resumed_from_step", 0) for a in doc.get("attempts", [])[1:]]
    lost = step - (resumed[0] if resumed else 0)
    return row("kill9-rank", not r.active(), lost, r.status(rc), r.leftovers(),
               f"{len(doc.get('attempts', []))} attempts, resumed from {resumed}")


def kill9_server(base, args):
    r = Run(base, "kill9-server", args)
    r.wait_step(3 * args.checkpoint_every)
    server = r.find("prefect.server.api.server:create_app")
    step, _ = r.fault_point()
    t = time.monotonic()
    if server is not None:
        server.kill()
    rc = r.wait_end(60)
    took = time.monotonic() - t
    after = r.checkpoint_step()
    last = r.last_step()
    tail = (r.dir / "stderr.log").read_text().strip().splitlines()[-1:] or [""]
    return row("kill9-server", not r.active(), max(0, last - after), "stopped" if rc == 1 and after >= step
               else r.status(rc), r.leftovers(), f"exit {rc} after {took:.0f} s: {tail[0][:100]}")


def _prefect_server(base: Path, port: int, marker: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(base / "dedicated-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", **{MARKER: marker})
    return subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port), "--no-ui"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_health(port: int, timeout_s: float = 180) -> bool:
    import urllib.request

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def server_restart(base, args):
    port = free_port()
    smark = uuid.uuid4().hex
    server = _prefect_server(base, port, smark)
    try:
        if not _wait_health(port):
            return row("server-restart", False, 0, "server did not start", 0)
        r = Run(base, "server-restart", args, env={"PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
        r.wait_step(3 * args.checkpoint_every)
        step, ck = r.fault_point()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
        time.sleep(5)                                  # the API is gone for a while
        server = _prefect_server(base, port, smark)
        _wait_health(port)
        rc = r.wait_end()
        doc = r.result()
        resumed = [a.get("resumed_from_step", 0) for a in doc.get("attempts", [])[1:]]
        lost = (step - resumed[0]) if resumed else 0
        return row("server-restart", not r.active(), lost, r.status(rc), r.leftovers(),
                   f"{len(doc.get('attempts', []))} attempt(s)")
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)


def _psql(admin_url: str, sql: str) -> None:
    import sqlalchemy

    eng = sqlalchemy.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sqlalchemy.text(sql))
    eng.dispose()


def db_outage(base, args):
    url = os.environ.get("FRENZY_TEST_POSTGRES_URL")
    if not url:
        return row("db-outage", None, 0, "skipped (no FRENZY_TEST_POSTGRES_URL)", 0)
    db = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    r = Run(base, "db-outage", args, extra=["--ledger", url])
    try:
        r.wait_step(2 * args.checkpoint_every)
        step, ck = r.fault_point()
        _psql(admin, f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
        _psql(admin, f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}'")
        time.sleep(20)
    finally:
        _psql(admin, f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
    rc = r.wait_end()
    ended = time.time()
    doc = r.result()
    resumed = [a.get("resumed_from_step", 0) for a in doc.get("attempts", [])[1:]]
    lost = (step - resumed[0]) if resumed else 0
    # an allocation the run could not release while the database was away: its lease must run
    # out within one TTL (nobody renews it), then the ledger frees it
    mine = [a for a in r.active(url) if a.job_id.startswith("faults-")]
    within = all(a.lease_expires_at <= ended + LEASE_TTL_S for a in mine)
    time.sleep(3)
    renewed = {a.id: a.lease_expires_at for a in mine} != {a.id: a.lease_expires_at for a in r.active(url)
                                                           if a.job_id.startswith("faults-")}
    for a in mine:                   # the ledger's expiry frees them within the TTL; the bench does not wait
        r.ledger(url).release(a.id)
    return row("db-outage", within and not renewed, lost, r.status(rc), r.leftovers(),
               f"ledger refused connections for 20 s (the run ended inside the outage); "
               f"{len(mine)} allocation(s) left to the lease TTL")


def clock_skew(base, args):
    r = Run(base, "clock-skew", args)
    r.wait_step(2 * args.checkpoint_every)
    held = r.active()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        expired = r.ledger().expire_leases(now=time.time() + LEASE_TTL_S + 1)     # a clock 301 s ahead
    step, ck = r.fault_point()
    rc = r.wait_end()
    status = r.status(rc)
    # right: the skewed clock expires nothing (leases expire by the database's clock)
    healthy = not expired and status == "completed"
    # steps lost: those trained after the lease was gone (on GPUs the ledger had given away)
    return row("clock-skew", healthy and not r.active(), 0 if not expired else max(0, r.last_step() - step),
               status if healthy else f"{status} (lease expired by a skewed clock)",
               r.leftovers(), f"expired {len(expired)} of {len(held)} allocation(s)")


def lease_lost(base, args):
    """The run's lease really runs out (as when its host stalled for a whole TTL): the reaper
    frees its GPUs, and the run must stop at its next step boundary, fenced."""
    from sqlmodel import update

    from ledger.tables import AllocationRow

    r = Run(base, "lease-lost", args)
    r.wait_step(2 * args.checkpoint_every)
    held = r.active()
    led = r.ledger()
    with led._tx() as s:
        s.execute(update(AllocationRow).where(AllocationRow.id.in_([a.id for a in held]))
                  .values(lease_expires_at=0.0))
    expired = led.expire_leases()
    t = time.monotonic()
    step, ck = r.fault_point()
    rc = r.wait_end()
    doc = r.result()
    after = max(0, r.last_step() - step)           # trained on GPUs the ledger had given away
    fenced = doc.get("status") == "failed" and "lease lost" in str(doc.get("error"))
    return row("lease-lost", bool(expired) and not r.active(), max(0, r.last_step() - r.checkpoint_step()),
               ("failed (fenced)" if fenced else r.status(rc)), r.leftovers(),
               f"expired {len(expired)} of {len(held)} allocation(s); {after} step(s) trained after the loss, "
               f"ended {time.monotonic() - t:.1f} s after it")


def readonly_runs(base, args):
    def prepare(home: Path) -> None:
        home.mkdir(parents=True)
        (home / "runs").write_text("not a folder\n")   # as root no mode bit stops a mkdir; a file does

    r = Run(base, "readonly-runs", args, prepare=prepare)
    rc = r.wait_end()
    err = (r.dir / "stderr.log").read_text().strip().splitlines()
    return row("readonly-runs", not r.active(), 0, r.status(rc), r.leftovers(),
               f"exit {rc}: {(r.result().get('error') or (err[-1] if err else ''))[:100]}")


def sigterm(base, args):
    r = Run(base, "sigterm", args)
    r.wait_step(3 * args.checkpoint_every)
    step, ck = r.fault_point()
    t = time.monotonic()
    r.proc.send_signal(signal.SIGTERM)
    rc = r.wait_end(60)
    took = time.monotonic() - t
    after = r.checkpoint_step()
    return row("sigterm", not r.active(), max(0, r.last_step() - after),
               r.status(rc) + f" (exit {rc})", r.leftovers(), f"stopped {took:.1f} s after the signal")


SCENARIOS = {"kill9-submitter": kill9_submitter, "kill9-rank": kill9_rank, "kill9-server": kill9_server,
             "server-restart": server_restart, "db-outage": db_outage, "clock-skew": clock_skew, "lease-lost": lease_lost,
             "readonly-runs": readonly_runs, "sigterm": sigterm}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help="comma-separated scenario names")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--checkpoint-every", type=int, default=25)
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    base = Path(tempfile.mkdtemp(prefix="frenzy-faults-"))
    rows = []
    for name in names:
        t = time.monotonic()
        try:
            rows.append(SCENARIOS[name](base, args))
        except Exception as err:
            rows.append(row(name, False, 0, f"bench error: {type(err).__name__}: {str(err)[:200]}", 0))
        print(f"# {name}: {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
    cmd = "python bench/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"command: {cmd}   (steps {args.steps}, checkpoint every {args.checkpoint_every}; folders under {base})")
    print(f"{'scenario':<16} {'gpus_freed':>10} {'steps_lost':>10} {'leftover':>8}  status / note")
    for r in rows:
        if r["gpus_freed"] is None:                  # did not run: neither green nor red
            print(f"{r['name']:<16} {'-':>10} {'-':>10} {'-':>8}  --- {r['status']}")
            continue
        green = r["gpus_freed"] and r["steps_lost"] <= args.checkpoint_every and r["leftover_processes"] == 0
        print(f"{r['name']:<16} {'yes' if r['gpus_freed'] else 'NO':>10} {r['steps_lost']:>10} "
              f"{r['leftover_processes']:>8}  {'ok ' if green else 'RED'} {r['status']}; {r['_note']}")
    if args.json:
        print(json.dumps({"scenarios": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
